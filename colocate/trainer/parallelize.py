"""Turn a plain model into a trainable FSDP2 one, in a fixed order: activation checkpointing ->
compile -> fully_shard per transformer block -> fully_shard of the root.

The model is built on the meta device, wrapped, and only then materialised: each rank allocates
just its own shards and fills them from the safetensors files (or a random init), so no rank ever
holds a full copy of the weights. Parameter names stay the HF names: checkpointing and compiling
replace a block's `forward`, they do not wrap the module.

The root FSDP unit holds the embeddings, the final norm and the heads. `hidden_states` is
registered as a forward method, so calling it gathers the root's parameters; the root keeps them
gathered until its backward (FSDP never reshards the root after forward), which is what lets the
caller use `lm_head.weight` on the hidden states right after.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from colocate.models.layers import rope_inv_freq

REST_MODES = ("none", "ops", "mlp")


@dataclass(frozen=True)
class ActivationCheckpointing:
    """What each transformer block keeps for its backward, trading recompute for memory.

    `full_fraction` of the blocks, spread evenly over depth from block 0, keep only their input
    and recompute their whole forward in backward ("full"); with `full_keeps_attention` they also
    keep attention's output and log-sum-exp ("attention"): about as many bytes again as the input,
    and the recompute skips attention, its costliest op per byte kept. The other blocks follow `rest`:
    "none" keeps every activation the backward reads; "ops" keeps the outputs of the matmuls and of
    attention and recomputes the element-wise work between them (norms, rotary, SiLU-and-multiply),
    which is a few percent of a block's time but about a third of what it would keep; "mlp" is
    "ops" but for the gate and up projections, whose outputs it recomputes with the element-wise
    work: most of what "ops" keeps, for a little over half of the block's forward GEMMs. What each
    plan costs and saves is measured by bench/trainer_throughput.py (docs/benchmarks/2026-12-trainer.md).
    """

    full_fraction: float = 0.0
    rest: str = "none"
    full_keeps_attention: bool = False

    def __post_init__(self):
        if not 0.0 <= self.full_fraction <= 1.0:
            raise ValueError(f"full_fraction={self.full_fraction} must be in [0, 1]")
        if self.rest not in REST_MODES:
            raise ValueError(f"rest={self.rest!r} must be one of {REST_MODES}")

    def block_modes(self, num_blocks: int) -> list[str]:
        """Per block: "full", "attention", "ops" or "none"."""
        count = round(self.full_fraction * num_blocks)
        full = {j * num_blocks // count for j in range(count)}
        mode = "attention" if self.full_keeps_attention else "full"
        return [mode if i in full else self.rest for i in range(num_blocks)]


def device_mesh(device: torch.device) -> DeviceMesh:
    """The 1-D mesh over all ranks that FSDP shards over (it wraps the default process group)."""
    return init_device_mesh(device.type, (torch.distributed.get_world_size(),))


@functools.cache
def _attention_ops() -> frozenset:
    """The attention ops of packed sequences: FlashAttention-4's, torch's varlen and CPU kernels, and
    the true on-policy mode's."""
    import torch.nn.attention.varlen  # noqa: F401 - registers torch_attn::_varlen_attn

    aten = torch.ops.aten
    return frozenset(
        {
            aten._flash_attention_forward.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.torch_attn._varlen_attn.default,
            torch.ops.colocate.flash_attention.default,
            torch.ops.colocate.invariant_attention.default,
        }
    )


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _matmul(op, args) -> tuple[int, int] | None:
    """(inner, output width) of a linear layer's matmul on flat tokens (mm(x, w_t), addmm(b, x, w_t),
    or the true on-policy mode's linear(x, w, b)); None for any other op."""
    if op == torch.ops.aten.mm.default:
        return args[0].shape[-1], args[1].shape[-1]
    if op == torch.ops.aten.addmm.default:
        return args[1].shape[-1], args[2].shape[-1]
    if op == torch.ops.colocate.invariant_linear.default:
        return args[0].shape[-1], args[1].shape[0]
    return None


def _keep_matmuls(recompute_width: int | None, low_rank: int, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep attention's output and the matmuls' (recomputing them would cost as much as the
    forward), but for matmuls of output width `recompute_width` and those of inner dimension
    `low_rank` (LoRA's rank: an adapter's products, cheap to recompute, among them the merge of its
    weight, which is as large as the weight)."""
    shape = _matmul(op, args)
    if op in _attention_ops() or (shape is not None and shape[1] != recompute_width and shape[0] != low_rank):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _contexts(mode: str, mlp_width: str, low_rank: str):
    """Block mode -> its selective recomputation's context. "full" keeps nothing but the input.
    "mlp" recomputes the matmuls of output width `mlp_width`: a block's gate and up projections
    (and any other of that width: only more recompute, never a wrong gradient); "ops" and "mlp"
    recompute the products of inner dimension `low_rank` (0: none)."""
    policy = {
        "full": _recompute_all,
        "attention": _keep_attention,
        "ops": functools.partial(_keep_matmuls, None, int(low_rank)),
        "mlp": functools.partial(_keep_matmuls, int(mlp_width), int(low_rank)),
    }[mode]
    return create_selective_checkpoint_contexts(policy)


def _checkpointed(forward, mode: str, mlp_width: int, low_rank: int = 0, random: bool = False):
    """`forward` recomputed in backward instead of keeping its activations (non-reentrant, so
    FSDP's hooks and torch.compile see ordinary autograd), but for the outputs that `mode` keeps
    (`mlp_width`: the block's intermediate size, for "mlp"; `low_rank`: its LoRA rank, 0 without).
    The RNG state is saved for the recomputation only when the forward is `random` (LoRA dropout):
    the models themselves draw no random numbers."""
    # torch.compile reads context_fn as a constant and guards on a partial's arguments by value;
    # the sizes go as strings because with dynamic shapes a bound int turns symbolic (the block
    # then runs eagerly), and a closure would be guarded by its code alone (all modes would share
    # the graph compiled first). "full" has a policy too, recomputing every op: compiled without
    # one, torch 2.11 left the ops of an autograd.Function in the block (LoRA's _MergedLinear)
    # untagged, so their outputs, and what the backward needed of them, were kept (an 8B LoRA
    # block on 16k tokens kept about 1.2 GB instead of its 0.13 GB input).
    extra = dict(context_fn=functools.partial(_contexts, mode, str(mlp_width), str(low_rank)))

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=random, **extra, **kwargs)

    return run


def compiles_random_recompute() -> bool:
    """Whether this torch compiles a recomputed block that draws random numbers (LoRA dropout):
    2.11's and 2.12's partitioner failed on one ("Node ... was invalid, but is output"); 2.13's
    compiles it."""
    return torch.torch_version.TorchVersion(torch.__version__) >= "2.13"


def _compiled_blocks(modes: list[str], compile: bool, random: bool) -> list[bool]:
    """Per block mode, whether the block is compiled: all with `compile`, but the recomputed ones
    when they draw random numbers and this torch cannot compile that (a warning says so)."""
    eager = compile and random and not compiles_random_recompute() and any(m != "none" for m in modes)
    if eager:
        warnings.warn(
            f"torch {torch.__version__} cannot compile a recomputed block with LoRA dropout: the "
            "recomputed blocks run uncompiled (slower); torch >= 2.13 compiles them, or set "
            "model.lora_dropout 0",
            stacklevel=4,
        )
    return [compile and not (eager and mode != "none") for mode in modes]


def _adapter_rank(block: nn.Module) -> int:
    """The rank of a block's LoRA adapters (their `lora_A` rows), 0 without."""
    return next((m.lora_A.out_features for m in block.modules() if hasattr(m, "lora_A")), 0)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    checkpointing: ActivationCheckpointing = ActivationCheckpointing(),
    compile: bool = False,
    forward_methods: tuple[str, ...] = ("hidden_states",),
    reshard_after_forward: bool = True,
    random: bool = False,
) -> nn.Module:
    """AC -> compile -> fully_shard(block) -> fully_shard(root), in place; returns the model.

    `param_dtype` is the compute dtype of the mixed-precision policy (gradients reduce in fp32);
    None computes in the parameters' own dtype. `checkpointing` says what each block recomputes.
    `compile` compiles each block's forward with dynamic shapes: the packed token count changes
    with every micro-batch, and one graph per block kind then serves them all.
    `forward_methods` are methods other than `forward` that callers use as the model's entry.
    `reshard_after_forward=False` keeps every block's gathered parameters until its backward
    (the last block always keeps them: its backward comes next).
    `random`: the training forward draws random numbers (dropout), which recomputation must repeat.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    blocks = list(model.model.layers)
    modes = checkpointing.block_modes(len(blocks))
    for i, (block, mode, compiled) in enumerate(zip(blocks, modes, _compiled_blocks(modes, compile, random))):
        if mode != "none":
            block.forward = _checkpointed(block.forward, mode, block.mlp.gate_proj.out_features, _adapter_rank(block), random)
        if compiled:
            block.forward = torch.compile(block.forward, dynamic=True)
        # The last block's parameters are needed again at once by the backward: keep them gathered.
        keep = not reshard_after_forward or i == len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep)
    # Gather the next block while this one computes, even when the host is not ahead of the device.
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) parameters of a meta-device model on `device`, and recompute the
    non-persistent rotary buffer (fp32) that `to_empty` leaves uninitialised."""
    model.to_empty(device=device)
    rotary = model.model.rotary
    cfg = model.config
    rotary.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _local_rows(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's dim-0 rows of `full`, as FSDP2 shards a parameter (torch.chunk sizes)."""
    if not hasattr(param, "to_local"):
        return full
    mesh = param.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = full.shape[0]
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return full[start : min(start + chunk, rows)]


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full (unsharded) tensor into a parameter, plain or FSDP2-sharded."""
    local = local_tensor(param)
    rows = _local_rows(param, full)
    if tuple(rows.shape) != tuple(local.shape):
        raise ValueError(f"shard of shape {tuple(rows.shape)} does not fit local {tuple(local.shape)}")
    local.copy_(rows)


def load_sharded(
    model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], source: str, *, skip: tuple[str, ...] = ()
) -> set[str]:
    """Copy HF-named full tensors into the model's shards; return the names that were filled.

    Names starting with one of `skip` are ignored (e.g. `lm_head.` for a critic built from a
    policy), as is `lm_head.weight` when the embeddings are tied.
    """
    params = dict(model.named_parameters())
    tied = getattr(model.config, "tie_word_embeddings", False)
    filled = set()
    for name, tensor in named:
        if name.startswith(skip) or (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in params:
            raise ValueError(f"{source}: unexpected tensor {name!r}")
        p = params[name]
        if tuple(tensor.shape) != tuple(p.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        copy_full_(p, tensor.to(device=local_tensor(p).device, dtype=p.dtype))
        filled.add(name)
    return filled


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a DTensor (an FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def init_random_(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights in place (normal(0, std) matrices, unit norms, zero biases), for benchmarks
    and new heads. Each rank draws its own shard, so values depend on the world size."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        local = local_tensor(p)
        if local.device not in gens:
            gens[local.device] = torch.Generator(device=local.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        elif name.endswith("bias"):
            local.zero_()
        else:
            local.normal_(0.0, std, generator=gens[local.device])


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reshard_all(model: nn.Module) -> None:
    """Free every gathered parameter (the root stays gathered after a forward without backward)."""
    for m in fsdp_modules(model):
        m.reshard()


def build_sharded(
    make: Callable[[], nn.Module],
    mesh: DeviceMesh,
    device: torch.device,
    *,
    dtype: torch.dtype,
    param_dtype: torch.dtype | None,
    weights: Iterable[tuple[str, torch.Tensor]] | None,
    source: str = "random init",
    skip: tuple[str, ...] = (),
    checkpointing: ActivationCheckpointing = ActivationCheckpointing(),
    compile: bool = False,
    forward_methods: tuple[str, ...] = ("hidden_states",),
    reshard_after_forward: bool = True,
    region: ContextManager | None = None,
    seed: int = 0,
    adapt: Callable[[nn.Module], None] | None = None,
    random: bool = False,
    allocated: Callable[[nn.Module], None] | None = None,
) -> tuple[nn.Module, set[str]]:
    """Build `make()` on the meta device in `dtype`, parallelize it, allocate its shards (inside
    `region` when given) and fill them from `weights`, or randomly when None. `adapt` changes the
    meta model in place after the cast and before sharding (LoRA adds fp32 adapters there);
    `random` as for `parallelize`; `allocated` sees the model once its shards are allocated, before
    they are filled (the offload's host buffers start pinning there, their sizes known).

    Returns the model and the parameter names that `weights` did not fill (the caller decides
    whether that is an error or a new head to initialise).
    """
    with torch.device("meta"):
        model = make().to(dtype)  # before sharding: FSDP shards (and allocates) in this dtype
        if adapt is not None:
            adapt(model)
    parallelize(
        model,
        mesh,
        param_dtype=param_dtype,
        checkpointing=checkpointing,
        compile=compile,
        forward_methods=forward_methods,
        reshard_after_forward=reshard_after_forward,
        random=random,
    )
    with region if region is not None else contextlib.nullcontext():
        materialize(model, device)
    if allocated is not None:
        allocated(model)
    names = {n for n, _ in model.named_parameters()}
    if weights is None:
        init_random_(model, seed)
        return model, set()
    return model, names - load_sharded(model, weights, source, skip=skip)
