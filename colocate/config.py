"""Typed configuration: one dataclass per concern under a root `Config`, loaded from YAML + CLI.

The fields and their help texts live here; reading them from YAML files and flags
(`load_config`) lives in colocate/config_loading.py, the checks in colocate/config_checks.py.

The defaults describe the toy run (colocate/toy.py: a tiny model that GRPO visibly improves on a
laptop CPU) without eval; configs/default.yaml adds eval, and recipes for real models set the
model, data, reward and optimiser fields.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from colocate import lora


def cache_root() -> Path:
    """Root of colocate's caches (the toy model and task, torch.compile's cache): $COLOCATE_CACHE,
    else ~/.cache/colocate."""
    return Path(os.environ.get("COLOCATE_CACHE") or "~/.cache/colocate").expanduser()


def use_compile_cache() -> None:
    """Keep torch.compile's cache (inductor's graphs and the Triton kernels it builds) under the
    cache root rather than in the temporary directory, so a rerun starts warm after /tmp is
    cleared; a TORCHINDUCTOR_CACHE_DIR the user set wins. Call before anything compiles."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


def _toy_path(name: str) -> str:
    return str(cache_root() / "toy" / name)


def _ranged(default: Any, spec: str) -> Any:
    """A field whose value must lie in `spec` (">= 1", "> 0", "(0, 1]", ...); None passes."""
    return field(default=default, metadata={"range": spec})


@dataclass
class ModelConfig:
    path: str = field(default_factory=lambda: _toy_path("model"))
    """HF model directory of the policy, or a Hub id owner/name[@revision] fetched into the Hub
    cache (default: the toy model, created on first use)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype of the engine's weights and the trainer's compute; auto = bf16 on CUDA, fp32 on CPU."""
    critic_path: str | None = None
    """HF model directory or Hub id the critic starts from (None = model.path); used by gae only."""
    ref_path: str | None = None
    """HF model directory or Hub id of the frozen reference policy (None = model.path; must be unset
    with model.lora_rank > 0, where the reference is the base with the adapters off)."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in backward to trade compute for memory (the same as
    recompute_fraction 1.0)."""
    recompute_fraction: float | None = _ranged(None, "[0, 1]")
    """Fraction of the trainer's blocks, spread over depth, that recompute their whole forward in
    backward; None: 1.0 with gradient_checkpointing, else 0."""
    recompute_rest: Literal["auto", "none", "ops", "mlp"] = "auto"
    """What the other blocks keep for backward: "none" every activation it reads; "ops" the outputs of
    the matmuls and of attention, recomputing the element-wise work (about a third of the memory);
    "mlp" as "ops" but recomputing the gate and up projections too (about a third of "ops"); "auto":
    with no recompute_fraction or gradient_checkpointing, the least of these that fits the step's
    tokens in one micro-batch in the GPU's free memory (colocate/sizing.py), else "none"."""
    recompute_keeps_attention: bool = False
    """The recomputed blocks also keep attention's output, about their input's size again, so their
    recompute skips attention."""
    compile: bool = False
    """torch.compile each transformer block of the trainer's model."""
    lora_rank: int = _ranged(0, ">= 0")
    """Rank of the LoRA adapters trained on a frozen base (0: off, every weight trains). With LoRA
    the base stays in the compute dtype without optimizer state, the reference policy is the base
    with the adapters off, a critic gets adapters too (its value head trains whole), and
    checkpoints hold the trained parameters only."""
    lora_alpha: float = _ranged(32.0, "> 0")
    """LoRA scaling numerator: the update is (lora_alpha / lora_rank) B A. A fixed alpha (rather
    than one that grows with the rank) keeps the best learning rate nearly the same across ranks."""
    lora_dropout: float = _ranged(0.0, "[0, 1)")
    """Dropout on the adapters' input in the training forward (not in the log-prob passes); must be 0
    with algorithm.true_on_policy."""
    lora_target_modules: list[str] = field(default_factory=lambda: list(lora.TARGET_MODULES))
    """Projections of each block that get adapters, each named once (default: every linear projection
    of attention and MLP); read with model.lora_rank > 0."""

    @property
    def full_recompute_fraction(self) -> float:
        """The fraction of blocks that recompute their whole forward: recompute_fraction, or 1.0
        with gradient_checkpointing and 0 without."""
        return self.recompute_fraction if self.recompute_fraction is not None else float(self.gradient_checkpointing)


@dataclass
class RolloutConfig:
    engine: Literal["native", "sglang"] = "native"
    """Rollout backend: the embedded native engine or SGLang's offline Engine."""
    prompt_data: str = field(default_factory=lambda: _toy_path("train.jsonl"))
    """Training prompts: JSONL, Parquet, a datasets save_to_disk directory, or a Hub data set
    owner/name[:config[:split]] (default: the toy task)."""
    input_key: str = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    label_key: str = "label"
    """Column holding the reference answer given to the reward function."""
    metadata_key: str = "metadata"
    """Column holding a per-prompt mapping passed through to the reward function (optional)."""
    apply_chat_template: bool = False
    """Format prompts with the tokenizer's chat template (with the generation prompt)."""
    system_prompt: str | None = None
    """System message before each prompt with apply_chat_template or rollout.env (None: the
    template's own default); a prompt whose messages begin with a system message keeps its own."""
    chat_template_kwargs: dict[str, bool | int | float | str] = field(default_factory=dict)
    """Extra variables of the chat template, e.g. {enable_thinking: false} for Qwen3; needs
    rollout.apply_chat_template or rollout.env."""
    max_prompt_len: int = _ranged(1024, ">= 1")
    """Prompts longer than this many tokens are dropped (and counted) when the data is loaded."""
    rollout_batch_size: int = _ranged(16, ">= 1")
    """Prompts per rollout step, across all ranks."""
    n_samples_per_prompt: int = _ranged(8, ">= 1")
    """Completions sampled per prompt (the group size of group-relative estimators)."""
    over_sampling_batch_size: int | None = None
    """Prompts sampled per round when rollout.dynamic_sampling refills, or groups in flight per step
    with rollout.partial_rollout, where it must be set, at most (rollout.max_staleness + 1) x
    rollout_batch_size (None = rollout_batch_size; read by nothing else)."""
    partial_rollout: bool = False
    """End a step's generation once rollout_batch_size groups are complete (of the
    over_sampling_batch_size in flight); unfinished samples are aborted, kept with their tokens,
    log-probs and weight versions, and continued first in the next step. A group trains once all
    its samples are complete. Native engine only (rollout.engine), and not with
    rollout.custom_generate or rollout.dynamic_sampling."""
    max_staleness: int = _ranged(1, ">= 1")
    """With partial_rollout: most weight versions a carried sample may lag behind the engine's
    (current version minus that of its oldest token); an older one restarts from its prompt,
    counted in rollout/partial/dropped_stale_samples."""
    partial_mask_stale_tokens: bool = True
    """With partial_rollout: leave tokens sampled by older weight versions out of the loss; off:
    train on them, their own rollout log-probs in the importance weights (algorithm.use_tis/use_mis)."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards all agree (no learning signal) and sample more to refill; needs
    rollout.n_samples_per_prompt >= 2."""
    max_sampling_rounds: int = _ranged(4, ">= 1")
    """Cap on sampling rounds per step when dynamic sampling refills; a short batch trains as is."""
    temperature: float = _ranged(1.0, ">= 0")
    """Sampling temperature; 0 is greedy, which a group-relative algorithm.advantage_estimator
    refuses (identical samples: every advantage 0)."""
    top_p: float = _ranged(1.0, "(0, 1]")
    """Nucleus sampling mass."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 keeps the whole vocabulary."""
    min_p: float = _ranged(0.0, "[0, 1)")
    """Drop tokens below min_p times the top probability."""
    max_response_len: int = _ranged(8, ">= 1")
    """Maximum generated tokens per completion."""
    stop_token_ids: list[int] = field(default_factory=list, metadata={"range": ">= 0"})
    """Extra token ids that end a completion, on top of the tokenizer's eos ids."""
    reward: str = "toy"
    """Reward function: toy, math, exact, f1, or module:function (or path/to/file.py:function) for
    a custom batched one; not with rollout.env, whose environment gives the reward."""
    custom_generate: str | None = None
    """module:function (or path/to/file.py:function) replacing the default group sampling (None =
    built-in)."""
    env: str | None = None
    """Multi-turn environment: a built-in one (toy_turns, math_python, reasoning_gym, verifiers), module:Class
    or path/to/file.py:Class (colocate/envs/base.py); its rewards replace rollout.reward. Not with
    rollout.partial_rollout, rollout.custom_generate or algorithm.overlong_buffer_len. None =
    single-turn sampling."""
    env_args: dict[str, bool | int | float | str] = field(default_factory=dict)
    """With rollout.env: keyword arguments of the environment's constructor."""
    max_turns: int = _ranged(4, ">= 1")
    """With rollout.env: most policy turns per episode."""
    max_episode_tokens: int | None = _ranged(None, ">= 1")
    """With rollout.env: most tokens after the first prompt (sampled and observations) per episode
    (None = rollout.max_response_len)."""
    turn_max_new_tokens: int | None = _ranged(None, ">= 1")
    """With rollout.env: most tokens sampled per turn, at most the episode's budget
    (rollout.max_episode_tokens or rollout.max_response_len; None = that budget)."""
    env_workers: int = _ranged(64, ">= 1")
    """With rollout.env: threads that run the environments' sync calls and the tools; episodes
    whose calls wait (sleeps, I/O) beyond this many at once wait their turn."""
    tool_timeout_s: float = _ranged(10.0, "> 0")
    """With rollout.env: seconds a tool call may take before the policy sees a timeout error."""
    env_timeout_s: float = _ranged(300.0, "> 0")
    """With rollout.env: seconds an environment's reset, step or reward may take; past it the episode
    is dropped as failed (a sync call keeps its thread until it returns)."""
    shuffle: bool = True
    """Shuffle the prompts each epoch (seeded by rollout.seed and the epoch)."""
    seed: int = 42
    """Seed of the prompt order and of the sampling."""
    gpu_memory_fraction: float | Literal["auto"] = _ranged("auto", "(0, 1)")
    """KV cache share of free GPU memory (native engine), or SGLang's mem_fraction_static; "auto":
    what one sampling round's sequences need at full length, within what the GPU has free once the
    trainer's share is counted (colocate/sizing.py; logged at start)."""
    max_kv_tokens: int = _ranged(65536, ">= 1")
    """KV cache size in tokens when running on CPU."""
    max_running_requests: int = _ranged(256, ">= 1")
    """Most sequences decoded at once by one engine."""
    cuda_graph: bool = True
    """Capture decode steps as CUDA graphs (GPU only)."""
    cuda_graph_max_bs: int = _ranged(256, ">= 1")
    """Largest decode batch size captured as a CUDA graph."""
    compile_decode: bool = True
    """torch.compile the native engine's decode forward on GPU, and its prefills of at least 4,096
    tokens (fuses their elementwise kernels; costs seconds of start-up, which a tiny model does not
    earn back)."""
    sglang_log_level: str = "error"
    """Log level of SGLang's engine and scheduler."""
    weight_sync_bucket_mb: int = _ranged(512, ">= 1")
    """Weight sync hands the engine full tensors in buckets of about this many MiB."""
    weight_dtype: Literal["bf16", "fp8"] = "bf16"
    """The native engine's decoder projections: bf16 keeps them in model.dtype; fp8 holds them in
    e4m3 with a scale per output row and runs FP8 GEMMs (half the weight bytes read per decode
    step; each weight sync quantizes on the GPU). The trainer stays in model.dtype, so
    algorithm.use_tis defaults to on. Native engine only; not with algorithm.true_on_policy."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """The native engine's KV cache: auto caches K/V in model.dtype; fp8_e4m3 in e4m3 with a scale
    per token and head (about half the bytes: twice the tokens in the same memory, and faster
    decode at long contexts). Native engine only; not with algorithm.true_on_policy."""

    @property
    def response_budget(self) -> int:
        """Most tokens after the prompt in one sample: a whole episode with rollout.env."""
        if self.env is not None and self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return self.max_response_len

    @property
    def fp8(self) -> bool:
        """Whether the rollout computes in FP8 (weights or KV cache): its log-probs are not the
        trainer's numerics."""
        return self.weight_dtype == "fp8" or self.kv_cache_dtype == "fp8_e4m3"


@dataclass
class AlgorithmConfig:
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"] = "grpo"
    """How advantages are computed from rewards (gae trains a critic); all but reinforce_plus_plus
    and gae need rollout.n_samples_per_prompt >= 2."""
    normalize_advantage_std: bool = True
    """Divide group-relative advantages by the group's reward std (GRPO); off: Dr. GRPO-style."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy objective: token-level PPO clip, sequence-level GSPO, or CISPO."""
    eps_clip: float = _ranged(0.2, "> 0")
    """Lower clip range of the importance ratio (1 - eps_clip); 1 or more: no lower bound."""
    eps_clip_high: float | None = None
    """Upper clip range (1 + eps_clip_high); None = eps_clip, larger = clip-higher (DAPO)."""
    dual_clip_c: float | None = _ranged(None, "> 1")
    """Dual-clip bound on the loss of negative-advantage tokens (None = off; must be > 1)."""
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How token losses are averaged into the batch loss."""
    use_kl_loss: bool = False
    """Add a KL penalty to the reference policy to the loss (loads the reference model)."""
    kl_loss_coef: float = _ranged(0.0, ">= 0")
    """Weight of the KL loss term."""
    kl_in_reward: bool = False
    """Subtract a per-token KL to the reference from the reward (loads the reference model)."""
    kl_reward_coef: float = _ranged(0.0, ">= 0")
    """Weight of the KL reward penalty."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """KL estimator used by the loss and the reward penalty."""
    entropy_coef: float = _ranged(0.0, ">= 0")
    """Weight of the entropy bonus."""
    use_tis: bool | None = None
    """Truncated importance sampling: weight tokens by min(p_train / p_rollout, tis_clip). None: on
    exactly when the rollout runs in FP8 (rollout.weight_dtype or rollout.kv_cache_dtype), whose
    log-probs differ from the trainer's more than bf16's do."""
    tis_clip: float = _ranged(2.0, "> 0")
    """Upper bound of the truncated importance weight."""
    use_mis: bool = False
    """Masked importance sampling: drop tokens whose p_train / p_rollout is out of the mis range."""
    mis_low: float = _ranged(0.5, "[0, 1]")
    """Lower bound of the kept importance ratio."""
    mis_high: float = _ranged(2.0, ">= 1")
    """Upper bound of the kept importance ratio."""
    overlong_buffer_len: int | None = None
    """Soft overlong penalty over the last this-many tokens of max_response_len (None = off)."""
    overlong_penalty_factor: float = _ranged(1.0, ">= 0")
    """Reward penalty at max_response_len, ramping linearly over the overlong buffer."""
    gamma: float = _ranged(1.0, "[0, 1]")
    """Discount of the return (gae, reinforce_plus_plus)."""
    lam: float = _ranged(0.95, "[0, 1]")
    """GAE lambda."""
    value_clip: float = _ranged(0.2, "> 0")
    """Clip range of the critic's value update around its old value."""
    num_critic_only_steps: int = _ranged(0, ">= 0")
    """Rollout steps at the start that train the critic only (algorithm.advantage_estimator gae)."""
    true_on_policy: bool = False
    """Batch-invariant numerics in the engine and the trainer, so that every sampled token's
    rollout log-prob equals the trainer's bit for bit (CPU fp32, CUDA bf16; slower). Needs
    rollout.engine native; the trainer may be compiled (model.compile), and the engine's decode
    runs uncompiled."""

    @property
    def use_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def needs_ref(self) -> bool:
        return self.use_kl_loss or self.kl_in_reward


@dataclass
class TrainConfig:
    num_rollout: int = _ranged(40, ">= 0")
    """Rollout steps to train for; 0 is an eval-only run, which needs eval.interval and eval.datasets."""
    lr: float = _ranged(5e-3, "> 0")
    """Peak learning rate of the policy."""
    critic_lr: float = _ranged(1e-5, "> 0")
    """Peak learning rate of the critic."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, over the optimizer steps of the whole run, down to min_lr_ratio * lr."""
    lr_warmup_steps: int = _ranged(0, ">= 0")
    """Optimizer steps of linear warm-up from 0."""
    min_lr_ratio: float = _ranged(0.0, "[0, 1]")
    """Final learning rate as a fraction of the peak (linear and cosine schedules)."""
    weight_decay: float = _ranged(0.0, ">= 0")
    """AdamW decoupled weight decay."""
    adam_beta1: float = _ranged(0.9, "[0, 1)")
    """AdamW beta1."""
    adam_beta2: float = _ranged(0.999, "[0, 1)")
    """AdamW beta2."""
    adam_eps: float = _ranged(1e-8, "> 0")
    """AdamW epsilon."""
    grad_clip: float = _ranged(1.0, "> 0")
    """Clip the global gradient norm to this value."""
    max_tokens_per_gpu: int | Literal["auto"] = _ranged("auto", ">= 1")
    """Token budget of one packed micro-batch on one GPU, at least one full sample
    (rollout.max_prompt_len + rollout.max_response_len, or rollout.max_episode_tokens with
    rollout.env); "auto": the rank's tokens of one optimizer
    step at full length, or as many as the GPU's free memory holds beside everything else the run
    keeps there (colocate/sizing.py; logged at start); 16384 at most without a GPU."""
    keep_gathered: bool | None = None
    """Keep the trained models' gathered (compute-dtype) parameters from a step's first forward to
    its last backward, and reduce gradients once per step instead of once per micro-batch: fewer
    collectives and less host work per micro-batch, for a full compute-dtype copy of the model
    and full-size fp32 gradients on every rank. None: on with one rank (whose shards are already
    the full model), off with several."""
    global_batch_size: int | None = _ranged(None, ">= 1")
    """Samples per optimizer step across ranks, dividing rollout.rollout_batch_size x
    rollout.n_samples_per_prompt (None = that whole rollout batch: one step per rollout)."""
    seed: int = 1
    """Seed of the trainer (initialisation of new heads, dropout-free otherwise)."""
    strict: bool = False
    """Make reward-function errors and memory-ledger growth fatal instead of logged."""
    max_skipped_steps: int = _ranged(10, ">= 1")
    """Stop with an error after this many optimizer steps in a row skipped for a non-finite loss or
    gradient norm."""


@dataclass
class OffloadConfig:
    offload_rollout: bool = False
    """Release the engine's weights, KV cache and CUDA graphs while training (with LoRA the weights
    stay: only the adapted modules change, and released weights would have to be pushed whole)."""
    offload_train: bool = False
    """Move the trainer's parameters, gradients and optimizer state off the GPU while generating.
    With "pinned", the optimizer state stays on the host through the forward passes too and comes
    back parameter by parameter during the last backward before its update, so the training peak
    does not hold it beside the activations."""
    method: Literal["pinned", "tms"] = "pinned"
    """Trainer offload: copies to pinned host memory, or torch_memory_saver pause/resume."""
    keep_adapters: bool = True
    """With LoRA and offload_train: the adapters, their gradients and AdamW moments stay on the GPU
    while generating (1.2 GB at 1.5B rank 64, 2.8 GB at 8B), and only the frozen base leaves. Moving
    them costs a step more host time (about 1,600 small tensors each way) than their bytes; off
    moves them too, for the KV cache to have their memory. Method "pinned" only: "tms" pauses each
    model's memory region whole."""


@dataclass
class EvalDataset:
    name: str = "eval"
    """Name used in the metric keys (eval/<name>/...)."""
    path: str = ""
    """Prompts, in any form rollout.prompt_data takes."""
    input_key: str = "prompt"
    """Column holding the prompt."""
    label_key: str = "label"
    """Column holding the reference answer."""
    metadata_key: str = "metadata"
    """Column holding per-prompt metadata for the reward function."""
    reward: str | None = None
    """Reward function (None = rollout.reward); not with rollout.env, whose environment scores the
    evaluation's episodes."""


@dataclass
class EvalConfig:
    interval: int | None = _ranged(None, ">= 1")
    """Evaluate every this-many rollout steps, before step 0 and at epoch ends (None = off)."""
    datasets: list[EvalDataset] = field(default_factory=list)
    """Evaluation sets (configs/default.yaml evaluates the toy task)."""
    n_samples_per_eval_prompt: int = _ranged(1, ">= 1")
    """Completions per eval prompt."""
    temperature: float = _ranged(0.0, ">= 0")
    """Eval sampling temperature; 0 is greedy."""
    top_p: float = _ranged(1.0, "(0, 1]")
    """Eval nucleus sampling mass."""
    max_response_len: int | None = _ranged(None, ">= 1")
    """Maximum generated tokens per eval completion (None = rollout.max_response_len); not with
    rollout.env, whose episodes keep rollout.max_episode_tokens and rollout.turn_max_new_tokens."""


@dataclass
class CheckpointConfig:
    save_interval: int | None = _ranged(None, ">= 1")
    """Save every this-many rollout steps, and at epoch ends (None: only as save_on_exit says)."""
    save_on_exit: bool = True
    """Save at the run's last step, and when SIGINT (Ctrl-C) or SIGTERM stops the run: the step in
    flight finishes its training and is saved, and the run exits with 130 or 143 (colocate/stopping.py)."""
    keep_last: int = _ranged(2, ">= 1")
    """Number of most recent checkpoints kept on disk."""
    resume: bool = True
    """Resume from the latest complete checkpoint in dir when there is one."""
    dir: str | None = None
    """Checkpoint directory (None = <output_dir>/checkpoints)."""


@dataclass
class LoggingConfig:
    wandb: bool = False
    """Log metrics to Weights & Biases (rank 0)."""
    wandb_project: str = "colocate"
    """W&B project."""
    run_name: str | None = None
    """Run name (None = the last part of output_dir)."""
    console: bool = True
    """Print a metrics table per step on rank 0."""


@dataclass
class Config:
    output_dir: str = "outputs/default"
    """Run directory: resolved config, metrics JSONL, checkpoints."""
    overwrite: bool = False
    """Start a fresh run in an output_dir that holds another run's metrics and log, replacing them.
    Checkpoints are never deleted: with checkpoints present the run is refused (drop --overwrite to
    resume, or choose another output_dir or checkpoint.dir)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy, reference and critic weights."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Prompts, sampling, rewards and the rollout engine."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and losses."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, optimiser and batching of the trainer."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Moving memory between the trainer and the engine on one GPU."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console, JSONL and W&B metrics."""

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def tis_on(self) -> bool:
        """Whether the update applies TIS: algorithm.use_tis, its None resolved (on with an FP8 rollout)."""
        return self.rollout.fp8 if self.algorithm.use_tis is None else self.algorithm.use_tis

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step, with None resolved to the whole rollout batch."""
        return self.train.global_batch_size or self.samples_per_rollout

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints go: checkpoint.dir, else OUTPUT_DIR/checkpoints."""
        return Path(self.checkpoint.dir or Path(self.output_dir) / "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_world_size(self, world_size: int) -> None:
        """Checks that need the number of ranks, run once the process group is up."""
        per_rank = [
            ("rollout.rollout_batch_size", self.rollout.rollout_batch_size),
            ("train.global_batch_size", self.global_batch_size),
            ("rollout.over_sampling_batch_size", self.rollout.over_sampling_batch_size),
        ]
        for name, value in per_rank:
            if value is None:
                continue
            if value % world_size:
                raise ValueError(f"{name}={value} must be divisible by the world size {world_size}")
