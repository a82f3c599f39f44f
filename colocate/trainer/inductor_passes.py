"""An inductor pass for the compiled transformer blocks: keep a matmul and the residual added to
it as two ops.

inductor's post-grad patterns turn `mm(x, w) + r` into `addmm(r, x, w)` whenever the sum has a user
that is not point-wise, which in a block is every residual add (the block's output, the next norm)
and the sum of the gate and up input gradients in backward. With a 2-D `r` cuBLAS cannot take it
as an epilogue bias: torch copies `r` into the output and runs a GEMM with beta=1, a different
kernel, which an H200 train profile suggests is much slower (beta=1 GEMMs of 0.76 ms beside plain
ones of 0.22-0.35 ms). Split back, the GEMM is the plain one and the add joins the norm or
point-wise kernel that reads the sum (or runs alone, for a block's output), as in eager mode, whose
rounding it then matches: one rounding after the GEMM, one after the add. Additions of a 1-D bias
stay fused: cuBLAS applies those in the GEMM's epilogue.
"""

from __future__ import annotations

import warnings

import torch
from torch._inductor import config, custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    KeywordArg,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

aten = torch.ops.aten
_PATTERNS = PatternMatcherPass()


def _adds_a_residual(match: Match) -> bool:
    """The addmm adds a full (tokens, width) tensor with unit scales, not a broadcast bias."""
    inp = match.kwargs["inp"]
    val = inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None
    scales = (match.kwargs.get("alpha", 1), match.kwargs.get("beta", 1))
    return isinstance(val, torch.Tensor) and val.dim() == 2 and scales == (1, 1)


def _split(match: Match, mat1, mat2, *, inp, **unit_scales) -> None:
    def repl(inp, mat1, mat2):
        return torch.mm(mat1, mat2) + inp

    match.replace_by_example(repl, [inp, mat1, mat2])


for _scales in ({}, dict(beta=KeywordArg("beta"), alpha=KeywordArg("alpha"))):
    register_graph_pattern(CallFunction(aten.addmm, KeywordArg("inp"), Arg(), Arg(), **_scales),
                           pass_dict=_PATTERNS, extra_check=_adds_a_residual)(_split)


class SplitResidualAddmm(CustomGraphPass):
    """The pass, as inductor's post-grad custom passes take it (its uuid keys inductor's caches)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _PATTERNS.apply(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def install() -> None:
    """Add the pass to the post-grad custom passes of inductor's process-wide config, once.
    Process-wide because the compiled blocks compile lazily, at their first call, and because a
    per-call `torch.compile(options=...)` would not reach other backends. Beside a pass already
    set where torch takes several (2.13 does); an older torch takes one, and then the pass set
    first stays, with a warning."""
    current = config.post_grad_custom_post_pass
    passes = tuple(current) if isinstance(current, (list, tuple)) else () if current is None else (current,)
    if any(isinstance(p, SplitResidualAddmm) for p in passes):
        return
    if not passes:
        config.post_grad_custom_post_pass = SplitResidualAddmm()
    elif hasattr(custom_graph_pass, "get_custom_graph_passes"):
        config.post_grad_custom_post_pass = (*passes, SplitResidualAddmm())
    else:
        warnings.warn("inductor's post_grad_custom_post_pass is already set and this torch takes one: "
                      "compiled blocks keep inductor's residual addmm fusion", stacklevel=2)
