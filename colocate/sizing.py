"""Sizes from free memory: the trainer's micro-batch, the engine's KV cache and the recompute plan
that one GPU holds, chosen at start for the settings the config leaves `auto`.

Before anything is loaded, `plan_memory` takes the device's free bytes and counts what each phase
will hold, from the model's shape and the run's settings:

    trainer state   fp32 master shards, fp32 gradients and two AdamW moments per trained parameter
                    (LoRA: the frozen base in the compute dtype, the adapters as above), plus the
                    gathered compute-dtype copy that train.keep_gathered holds through a step
    engine          a full compute-dtype copy of the weights and the KV cache (released during
                    training with offload.offload_rollout; LoRA keeps the weights)
    activations     per token, what each block keeps for its backward under its recompute mode,
                    plus one block's worth for the backward in progress and the log-prob kernel's
                    fixed workspace

The KV cache gets what one sampling round's sequences need at their full length (the rollout or
over-sampling batch's samples, up to rollout.max_running_requests, times prompt + response tokens)
with KV_SLACK, or less when the device has less; an eval set with more sequences runs in waves.
The micro-batch gets the rank's tokens of one optimizer step when they fit, so that a step is one
forward and one backward; with the recompute plan left to choose,
it recomputes as little as lets that whole step fit (none, then "ops", then "mlp"), and otherwise
recomputes "mlp" and takes as many tokens as fit. HEADROOM of the device stays unplanned for the
allocator's fragmentation, cuBLAS and NCCL workspaces and CUDA graphs.

The plan is a forecast: a run that still runs out of memory says which setting to lower
(colocate/colocation/ledger.py), and each step's memory ledger shows the real peaks beside
`memory/plan/*`, the forecast.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
HEADROOM = 0.08
"""Share of the device's memory left out of the plan."""
KV_SLACK = 1.25
"""KV cache over what one sampling round needs: block rounding, and room for retries after preemption."""
MIN_KV_BYTES = 256 << 20
LOGPROB_WORKSPACE = 1 << 30
"""The log-prob kernel's fp32 tile and its gradient (colocate/kernels/logprob.py MAX_CHUNK_ELEMENTS)."""
AUTO = "auto"
CPU_MAX_TOKENS = 16384
"""train.max_tokens_per_gpu auto without a GPU: nothing to measure, a budget that keeps host memory modest."""
AUTO_RESTS = ("none", "ops", "mlp")
"""What a non-recomputed block keeps, least recompute first (colocate/trainer/parallelize.py)."""


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: widths per token and parameter counts."""

    hidden: int
    q_width: int  # heads x head_dim
    kv_width: int  # KV heads x head_dim
    intermediate: int
    num_layers: int
    qk_norm: bool
    num_params: int
    lora_params: int = 0  # adapters (0 without LoRA)

    @classmethod
    def of(cls, mcfg, lora_rank: int = 0, lora_targets: tuple[str, ...] = ()) -> "Shape":
        h, i, q, kv = (
            mcfg.hidden_size,
            mcfg.intermediate_size,
            mcfg.num_attention_heads * mcfg.head_dim,
            mcfg.num_key_value_heads * mcfg.head_dim,
        )
        per_block = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h  # projections and norms
        per_block += (q + 2 * kv) * mcfg.attention_bias + 2 * mcfg.head_dim * mcfg.qk_norm
        embeddings = mcfg.vocab_size * h * (1 if mcfg.tie_word_embeddings else 2)
        widths = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }
        adapters = sum(lora_rank * (widths[t][0] + widths[t][1]) for t in lora_targets if t in widths)
        return cls(
            h,
            q,
            kv,
            i,
            mcfg.num_hidden_layers,
            mcfg.qk_norm,
            mcfg.num_hidden_layers * per_block + embeddings + h,
            adapters * mcfg.num_hidden_layers,
        )

    def engine_weight_bytes(self, itemsize: int, fp8: bool) -> int:
        """The engine's copy of the weights: in the compute dtype, or with every decoder projection
        in e4m3 (1 byte) plus an fp32 scale per output row (rollout.weight_dtype fp8)."""
        total = self.num_params * itemsize
        if fp8:
            h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
            projections = self.num_layers * (2 * h * q + 2 * h * kv + 3 * h * i)
            rows = self.num_layers * (q + 2 * kv + h + 2 * i + h)
            total -= projections * (itemsize - 1) - rows * 4
        return total

    def kept_per_token(self, mode: str) -> int:
        """Elements one block keeps for its backward per token, by recompute mode."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        norm = (q + kv) if self.qk_norm else 0
        kept = {
            # block input, two norm outputs and inputs, q/k/v before and after rotary, attention's
            # output, gate, up, SiLU(gate) and the product that down_proj reads
            "none": 4 * h + 3 * q + 3 * kv + 4 * i + norm,
            # matmul and attention outputs, the block input
            "ops": 3 * h + 2 * q + 2 * kv + 2 * i,
            "mlp": 3 * h + 2 * q + 2 * kv,
            "attention": 2 * h,
            "full": h,
        }
        return kept[mode]


@dataclass(frozen=True)
class RunNeeds:
    """What the run's settings ask of one rank, in tokens and flags (`needs_of` builds it)."""

    step_tokens: int  # tokens of this rank's share of one optimizer step, at full length
    sample_tokens: int  # one sample at full length: the smallest micro-batch that trains it
    kv_tokens: int  # one sampling round's sequences at full length
    world_size: int
    itemsize: int  # compute dtype
    fp8_weights: bool  # the engine's projections in e4m3 (rollout.weight_dtype)
    keep_gathered: bool
    offload_train: bool
    offload_rollout: bool
    critic: bool
    lora: bool
    modes: tuple[str, ...] | None  # the user's per-block recompute modes; None: the plan's to choose
    max_tokens: int | None  # the user's micro-batch budget; None: the plan's to choose
    kv_fraction: float | None  # the user's KV share of free memory; None: the plan's to choose


@dataclass(frozen=True)
class MemoryPlan:
    max_tokens_per_gpu: int
    kv_cache_tokens: int | None  # None: the engine sizes it from rollout.gpu_memory_fraction
    static_fraction: float | None  # SGLang's mem_fraction_static for the same weights and KV cache
    recompute_rest: str | None  # None: the user's plan stands
    reason: str
    forecast: dict[str, float]  # memory/plan/* metrics

    def summary(self) -> str | None:
        """The start-up's line on the sizes chosen, or None when the config chose them all."""
        return f"sizes from free memory: {self.reason}" if self.reason else None


def plan_memory(shape: Shape, needs: RunNeeds, free_bytes: int, total_bytes: int, kv_bytes_per_token: int) -> MemoryPlan:
    """The sizes for one rank with `free_bytes` of `total_bytes` free before anything is loaded."""
    usable = free_bytes - HEADROOM * total_bytes
    trainer = _trainer_bytes(shape, needs)
    engine_weights = shape.engine_weight_bytes(needs.itemsize, needs.fp8_weights)
    gen_trainer = _generation_trainer_bytes(shape, needs, trainer)
    if needs.kv_fraction is None:
        gen_room = usable - gen_trainer - engine_weights
        if gen_room < MIN_KV_BYTES:
            raise ValueError(
                f"rollout.gpu_memory_fraction auto: {free_bytes / GIB:.1f} GiB free leave no room for a KV cache "
                f"beside the engine's weights ({engine_weights / GIB:.1f} GiB) and the trainer's state while "
                f"generating ({gen_trainer / GIB:.1f} GiB): turn on offload.offload_train, use more GPUs, or set "
                "rollout.gpu_memory_fraction"
            )
        wanted = max(MIN_KV_BYTES, int(needs.kv_tokens * kv_bytes_per_token * KV_SLACK))
        kv_bytes = int(min(wanted, gen_room))
    else:  # the engine's share of what is free once it has loaded its weights
        kv_bytes = int(needs.kv_fraction * max(free_bytes - gen_trainer - engine_weights, 0))
    if not needs.offload_rollout:
        held = engine_weights + kv_bytes
    else:  # LoRA's engine keeps its weights through training: only the adapted modules change
        held = engine_weights if needs.lora else 0
    room = usable - trainer - held - LOGPROB_WORKSPACE
    rest = None
    modes = needs.modes
    if modes is None:
        rest = _least_recompute(shape, needs, room)
        modes = (rest,) * shape.num_layers
    per_token = _activation_bytes_per_token(shape, needs, modes)
    fit = max(0, int(room // per_token))
    max_tokens = needs.max_tokens or max(needs.sample_tokens, min(needs.step_tokens, fit))
    forecast = {
        "memory/plan/train_peak_gib": (trainer + held + LOGPROB_WORKSPACE + max_tokens * per_token) / GIB,
        "memory/plan/kv_cache_gib": kv_bytes / GIB,
        "memory/plan/activation_mib_per_token": per_token / (1 << 20),
    }
    parts = [f"{free_bytes / GIB:.1f} of {total_bytes / GIB:.1f} GiB free"]
    if needs.max_tokens is None:
        parts.append(f"train.max_tokens_per_gpu {max_tokens} ({_why_tokens(needs, max_tokens, fit, room, per_token)})")
    if rest is not None:
        parts.append(f"model.recompute_rest {rest!r}")
    if needs.kv_fraction is None:
        parts.append(
            f"KV cache {kv_bytes / GIB:.2f} GiB (a sampling round's {needs.kv_tokens} tokens x {KV_SLACK}, "
            f"at least {MIN_KV_BYTES >> 20} MiB, at most what generation leaves)"
        )
    if needs.kv_fraction is not None:
        return MemoryPlan(max_tokens, None, None, rest, "; ".join(parts), forecast)
    # SGLang's KV cache is what is free after its weights less (1 - mem_fraction_static) of the device.
    after_weights = free_bytes - gen_trainer - engine_weights
    static = min(0.95, 1 - (after_weights - kv_bytes) / total_bytes)
    return MemoryPlan(max_tokens, kv_bytes // kv_bytes_per_token, static, rest, "; ".join(parts), forecast)


def _why_tokens(needs: RunNeeds, max_tokens: int, fit: int, room: float, per_token: float) -> str:
    at = f"{room / GIB:.1f} GiB for activations at {per_token / (1 << 20):.2f} MiB a token"
    if fit < needs.sample_tokens:
        return f"one sample, which may not fit {at}"
    if max_tokens >= needs.step_tokens:
        return "the step's tokens in one micro-batch"
    return f"what fits {at}"


def _trainer_bytes(shape: Shape, needs: RunNeeds) -> float:
    """The trainer's state during a step, per rank."""
    shard = shape.num_params / needs.world_size
    if needs.lora:
        state = shard * needs.itemsize + shape.lora_params / needs.world_size * 16
    else:
        state = shard * 16  # fp32 master, fp32 gradient, two fp32 moments
    gathered = (
        shape.num_params * needs.itemsize if needs.keep_gathered else 2 * shape.num_params / shape.num_layers * needs.itemsize
    )
    return (2 if needs.critic else 1) * (state + gathered)


def _generation_trainer_bytes(shape: Shape, needs: RunNeeds, trainer: float) -> float:
    """What the trainer leaves on the device while the engine generates."""
    if not needs.offload_train:
        return trainer
    return shape.lora_params / needs.world_size * 16 if needs.lora else 0.0


def _activation_bytes_per_token(shape: Shape, needs: RunNeeds, modes: tuple[str, ...]) -> float:
    kept = sum(shape.kept_per_token(m) for m in modes)
    in_flight = 2 * shape.kept_per_token("none")  # the block in backward: its activations and their gradients
    adapters = 2 * shape.lora_params // max(1, shape.hidden) if needs.lora else 0  # x A^T per adapted projection
    return needs.itemsize * (kept + in_flight + adapters) + 64  # + fp32/int64 per-token inputs of the loss


def _least_recompute(shape: Shape, needs: RunNeeds, room: float) -> str:
    """The least recompute that fits the micro-batch (the step's tokens, or the user's budget) in
    `room`; "mlp" when none does."""
    tokens = needs.max_tokens or needs.step_tokens
    for rest in AUTO_RESTS:
        if tokens * _activation_bytes_per_token(shape, needs, (rest,) * shape.num_layers) <= room:
            return rest
    return AUTO_RESTS[-1]


def needs_of(cfg, world_size: int, itemsize: int, keep_gathered: bool, modes: tuple[str, ...] | None) -> RunNeeds:
    """What `cfg` (colocate.config.Config) asks of one of `world_size` ranks."""
    r, t = cfg.rollout, cfg.train
    sample = r.max_prompt_len + r.response_budget
    per_rank = -(-cfg.global_batch_size // world_size)
    prompts = max(1, max(r.rollout_batch_size, r.over_sampling_batch_size or 0) // world_size)
    sequences = prompts * r.n_samples_per_prompt
    return RunNeeds(
        step_tokens=per_rank * sample,
        sample_tokens=sample,
        kv_tokens=min(sequences, r.max_running_requests) * sample,
        world_size=world_size,
        itemsize=itemsize,
        fp8_weights=r.weight_dtype == "fp8",
        keep_gathered=keep_gathered,
        offload_train=cfg.offload.offload_train,
        offload_rollout=cfg.offload.offload_rollout,
        critic=cfg.algorithm.use_critic,
        lora=cfg.model.lora_rank > 0,
        modes=modes,
        max_tokens=None if t.max_tokens_per_gpu == AUTO else t.max_tokens_per_gpu,
        kv_fraction=None if r.gpu_memory_fraction == AUTO else r.gpu_memory_fraction,
    )


def cpu_plan(needs: RunNeeds) -> MemoryPlan:
    """Without a GPU there is no device memory to plan: the step's tokens up to CPU_MAX_TOKENS."""
    max_tokens = needs.max_tokens or max(needs.sample_tokens, min(needs.step_tokens, CPU_MAX_TOKENS))
    reason = (
        "" if needs.max_tokens else f"no GPU: train.max_tokens_per_gpu {max_tokens} (the step's tokens, at most {CPU_MAX_TOKENS})"
    )
    return MemoryPlan(max_tokens, None, None, None if needs.modes else "none", reason, {})
