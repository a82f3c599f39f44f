"""Compile the Triton kernels for a GPU architecture on a machine without a GPU, through their real
launch sites, and print one JSON line per compiled kernel: its name, its constexprs, the tensor-core
instruction of its PTX (tcgen05 on Blackwell, wgmma on Hopper, mma.sync, or none) and the cubin's
registers, stack, local memory (spills), shared memory and whether its machine code fuses an fp32
multiply and add (FFMA), as cuobjdump reports them.

    python tests/compile_for_gpu.py [--arch 90|100]   (sm_90: H100/H200, the default; sm_100: B200)
    python tests/compile_for_gpu.py --lora-merge-graph  (the graph a compiled LoRA merge gives inductor)
    (run by tests/unit/test_kernels_compile.py, with TRITON_INTERPRET unset)

A stand-in driver reports such a device, and every launch becomes a warm-up: Triton specialises
the arguments (alignment, strides of 1, constexprs) as on the GPU and compiles to PTX and a cubin
with its bundled ptxas, but nothing runs. The inputs are CPU tensors at model shapes (bf16, the
0.5B and 1.5B heads); the kernels' private launchers are called where the public ones pick the CPU
path. What the GPU would fail to compile fails here, before any device time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
BF16 = torch.bfloat16


class StandInDriver:
    """What JITFunction.run asks of the active driver before it launches."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)


def resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(CUOBJDUMP), "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    fields = dict(part.split(":", 1) for part in line.split() if ":" in part)
    return {
        "registers": int(fields["REG"]),
        "stack": int(fields["STACK"]),
        "local": int(fields["LOCAL"]),
        "fp32_fma": " FFMA" in sass,
    }


def compile_all(arch: int) -> list[dict]:
    compiled: list[dict] = []
    launch = JITFunction.run

    def warm_up(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        constexprs = {k: v for k, v in kwargs.items() if k.isupper()}
        ptx = kernel.asm["ptx"]
        mma = next((name for name in ("tcgen05.mma", "wgmma", "mma.sync") if name in ptx), None)
        compiled.append(
            {
                "kernel": self.__name__,
                "constexprs": constexprs,
                "shared": kernel.metadata.shared,
                "mma": mma,
                **resources(kernel.asm["cubin"]),
            }
        )
        return kernel

    driver.set_active(StandInDriver(arch))  # for the rest of this process, which does nothing else
    JITFunction.run = warm_up
    launch_every_kernel()
    return compiled


def launch_every_kernel() -> None:
    from colocate.kernels import (
        batch_invariant_cuda,
        invariant_attention,
        logprob,
        lora_merge,
        paged_attention,
        rotary,
        sampling,
    )
    from tests.unit.test_kernel_paged_attention import _paged_inputs

    def randn(*shape, dtype=BF16):
        return torch.randn(*shape).to(dtype)

    # The mode's products in every tile config: one K chunk (0.5B's qkv, with bias), two walked in one
    # program (the down projection) where the config takes them, and split over programs in the
    # smallest; and the lm_head's fp32 logits.
    x, w = randn(256, 896), randn(1152, 896)
    down_in, down_w = randn(256, 4864), randn(896, 4864)
    block_k = batch_invariant_cuda.BLOCK_K[BF16]
    for block_m, block_n, warps, stages, wide_only in batch_invariant_cuda.TILES[BF16]:
        config = (block_m, block_n, block_k, warps, stages)
        batch_invariant_cuda.matmul(x, w.T, randn(1152), config=config)
        if not wide_only:
            batch_invariant_cuda.matmul(down_in, down_w.T, config=config, split=False)
    block_m, block_n, warps, stages, _ = batch_invariant_cuda.TILES[BF16][-1]  # the only one that splits
    batch_invariant_cuda.matmul(down_in, down_w.T, config=(block_m, block_n, block_k, warps, stages), split=True)
    batch_invariant_cuda.matmul(x, randn(4096, 896).T, out_dtype=torch.float32)
    batch_invariant_cuda.rms_norm(x, randn(896), 1e-6)
    batch_invariant_cuda.rms_norm(randn(256, 12, 128), randn(128), 1e-6)  # qk-norm: a row per head
    batch_invariant_cuda.add_rms_norm(x, randn(256, 896), randn(896), 1e-6)
    batch_invariant_cuda.silu_mul(*randn(256, 2 * 4864).chunk(2, dim=-1))
    sampling.invariant_logsumexp(randn(4, 151936, dtype=torch.float32))
    sampling.invariant_logsumexp_and_entropy(randn(4, 151936, dtype=torch.float32))
    for heads, kv_heads, dim in ((14, 2, 64), (12, 2, 128)):
        lens = [40, 300, 1]
        n = sum(lens)
        q, k, v = randn(n, heads, dim), randn(n, kv_heads, dim), randn(n, kv_heads, dim)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        invariant_attention.packed_attention(q, k, v, cu, dim**-0.5)
        cache_q, k_cache, v_cache, tables, context = _paged_inputs(lens, heads, kv_heads, dim, 16, dtype=BF16)
        invariant_attention.paged_decode_attention(cache_q, k_cache, v_cache, tables, context, dim**-0.5)
        invariant_attention.paged_prefill_attention(q[:41], k_cache, v_cache, tables[:2], [40, 1], [40, 1], dim**-0.5)
        rotary._launch(q, k, randn(n, dim), randn(n, dim), False)
        for splits in (1, 4):
            config = paged_attention.DecodeConfig(block_n=128 if dim <= 64 else 64, num_splits=splits, num_warps=4, num_stages=3)
            paged_attention._paged_decode_triton(cache_q, k_cache, v_cache, tables, context, dim**-0.5, config)
    logits = randn(8, 151936, dtype=torch.float32)
    temperature, seed, counter = torch.ones(8), torch.arange(8), torch.arange(8)
    for config in (sampling.SampleConfig(1), sampling.SampleConfig(4)):
        sampling._gumbel_sample_triton(logits, temperature, seed, counter, None, None, config)
    sampling.invariant_gumbel_sample(logits, temperature, seed, counter)  # the mode's: no division
    for rank in (8, 64, 128):  # a rank padded up to tl.dot's 16, one chunk, two chunks
        lora_merge._launch(
            randn(8960, 1536), randn(rank, 1536, dtype=torch.float32), randn(8960, rank, dtype=torch.float32), 0.5, BF16
        )
    rows = 16
    chunk, targets = randn(rows, 8192, dtype=torch.float32), torch.randint(0, 151936, (rows,))
    state = [torch.zeros(rows) for _ in range(4)]
    for with_entropy in (False, True):
        logprob._chunk_stats_triton(chunk, targets, 8192, 1.0, with_entropy, *state)
        entropy = torch.zeros(rows) if with_entropy else None
        logprob._chunk_grad_triton(chunk, targets, 8192, 1.0, state[0], state[1], entropy, entropy, BF16)


def lora_merge_graph(arch: int) -> dict:
    """What AOTAutograd hands inductor for a compiled LoRA merge: the graph's calls, the kernel it
    launches and the arguments it copies before the launch (those the kernel is found to write)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    from colocate.kernels.lora_merge import lora_merge

    graphs = []

    def keep_graph(graph, example_inputs):
        graphs.append(graph)
        return lambda *args: [torch.empty(40, 24, dtype=BF16)]  # nothing runs here

    driver.set_active(StandInDriver(arch))
    merge = torch.compile(
        lambda w, a, b: lora_merge(w, a, b, 2 / 3, BF16), backend=aot_autograd(fw_compiler=keep_graph), fullgraph=True
    )
    merge(torch.randn(40, 24, dtype=BF16), torch.randn(16, 24), torch.randn(40, 16))
    calls = [node for node in graphs[0].graph.nodes if node.op == "call_function" and "getitem" not in node.name]
    launch = calls[-1].kwargs
    return {
        "calls": [str(node.target) for node in calls],
        "kernel": kernel_side_table.get_kernel(launch["kernel_idx"]).fn.__name__,
        "tensors_to_clone": launch["tensors_to_clone"],
    }


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=(90, 100))
    parser.add_argument("--lora-merge-graph", action="store_true", help="trace a compiled LoRA merge instead")
    args = parser.parse_args()
    if args.lora_merge_graph:
        print(json.dumps(lora_merge_graph(args.arch)))
    else:
        for row in compile_all(args.arch):
            print(json.dumps(row), flush=True)
