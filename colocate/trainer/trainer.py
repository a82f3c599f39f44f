"""`Trainer`: what the loop calls to train on a rollout batch. It owns the actor and, when the
algorithm needs them, the reference model and the critic, and their memory (`self.memory`, a
`TrainerMemory`; the colocation handoff decides when it moves).

With `model.lora_rank` > 0 the actor is a frozen base (compute dtype, no optimizer state, no
gradients) with trained fp32 adapters (colocate/trainer/lora.py), and the reference policy is
that same model with its adapters off. The critic then gets adapters too, and a value head
trained whole.

Per `train` call: pack the rank's samples into micro-batches agreed over ranks; old log-probs
(only when needed: several optimizer steps, or KL in the reward), reference log-probs, values;
advantages; critic steps (before the actor, as GAE's targets come from the values just read);
actor steps unless the run is still in its critic-only warm-up.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.profiler import record_function

from colocate import dist
from colocate.config import Config
from colocate.kernels.ops import Ops
from colocate.kernels.paged_attention import kv_bytes_per_token
from colocate.lora.identity import LoRASpec, is_adapter
from colocate.models import ArchConfig, CausalLM, iter_safetensors, resolve_dtype
from colocate.rollout.sample import Sample
from colocate.sizing import AUTO, MemoryPlan, Shape, cpu_plan, needs_of, plan_memory
from colocate.timing import timed
from colocate.trainer.actor import Actor
from colocate.trainer.batch import RolloutBatch
from colocate.trainer.critic import Critic, ValueModel, add_critic_adapters, zero_value_head_
from colocate.trainer.global_advantages import compute_advantages, global_masked_mean
from colocate.trainer.lora import adapters_disabled, add_adapters, init_adapters_
from colocate.trainer.memory import (
    ACTOR_OPTIM,
    ACTOR_PARAMS,
    CRITIC_OPTIM,
    CRITIC_PARAMS,
    REFERENCE,
    StateArrival,
    TrainerMemory,
)
from colocate.trainer.optim import LRSchedule, OptimizerStep, init_optimizer_state
from colocate.trainer.parallelize import ActivationCheckpointing, build_sharded, device_mesh
from colocate.trainer.passes import pass_parts, plan_steps
from colocate.trainer.reference import Reference


def _summarize(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Per-step metrics -> one dict: shares averaged over steps (maxima maximised), grad_norm
    averaged, the last lr, the number of skipped steps."""
    out = {
        f"{prefix}grad_norm": sum(s["grad_norm"] for s in steps) / len(steps),
        f"{prefix}lr": steps[-1]["lr"],
        f"{prefix}skipped_steps": sum(s["skipped"] for s in steps),
    }
    for name in steps[0]:
        if name.endswith("_max"):
            out[name] = max(s[name] for s in steps)
        elif name not in ("grad_norm", "lr", "skipped"):
            out[name] = sum(s[name] for s in steps) / len(steps)
    return out


class Trainer:
    """Actor (+ reference, + critic) for one rank. `model_config` builds randomly initialised
    models of that shape instead of loading cfg.model.path (benchmarks); `checkpointing`
    overrides the recomputation plan of cfg.model (gradient_checkpointing, recompute_*).
    The pinned host buffers of the models that move (with cfg.offload.offload_train, the actor's
    and critic's; the reference's always) start pinning here, once, on helper threads
    (`TrainerMemory.reserve`), so that no offload during training pays for pinning host memory and
    the start-up does not stop for it.
    `ops`: the run's table of operations (colocate/kernels/ops.py), which every model built here
    computes with (with algorithm.true_on_policy, the mode's, built by the caller); default
    `Ops.standard()`."""

    def __init__(
        self,
        cfg: Config,
        info: dist.DistInfo,
        *,
        ops: Ops | None = None,
        model_config: ArchConfig | None = None,
        checkpointing: ActivationCheckpointing | None = None,
    ):
        self.cfg, self.info = cfg, info
        self.ops = Ops.standard() if ops is None else ops
        m, t, a, r = cfg.model, cfg.train, cfg.algorithm, cfg.rollout
        self.device = info.device
        self.compute_dtype = resolve_dtype(m.dtype, self.device)
        self.mesh = device_mesh(self.device)
        self.memory = TrainerMemory(cfg.offload.method, self.device)
        self.random_config = model_config
        self.keep_gathered = info.world_size == 1 if t.keep_gathered is None else t.keep_gathered
        policy_cfg = model_config or ArchConfig.from_dir(m.path)
        self.memory_plan = self._plan_memory(policy_cfg, checkpointing)
        self.checkpointing = checkpointing or ActivationCheckpointing(
            m.full_recompute_fraction, m.recompute_rest, m.recompute_keeps_attention
        )
        steps_per_rollout = -(-cfg.samples_per_rollout // cfg.global_batch_size)
        actor_rollouts = t.num_rollout - (a.num_critic_only_steps if a.use_critic else 0)
        norm_len = r.response_budget

        self.startup_seconds: dict[str, float] = {}
        """Where the time of building went (the parts that were built): actor (load, shard,
        optimizer state), reference, critic, and on CUDA pinned_buffers (their layouts, within the
        parts above: helper threads pin them behind the rest of the start-up)."""

        self.vocab_size = policy_cfg.vocab_size
        self.lora = LoRASpec.from_config(m)
        with timed(self.startup_seconds, "actor", self.device):
            actor_model = self._build(
                lambda: CausalLM(policy_cfg, self.ops),
                m.path,
                ACTOR_PARAMS,
                train=True,
                lora=self.lora,
                pin=cfg.offload.offload_train,
            )
            actor_opt, arrival = self._optimizer(actor_model, t.lr, ACTOR_OPTIM, max(1, actor_rollouts * steps_per_rollout))
        self.actor = Actor(
            actor_model,
            actor_opt,
            arrival,
            a,
            temperature=r.temperature,
            norm_len=norm_len,
            keep_gathered=self.keep_gathered,
            use_tis=cfg.tis_on,
        )

        self.reference = None
        if a.needs_ref and self.lora is not None:
            self.reference = Reference(
                actor_model,
                self.memory,
                REFERENCE,
                temperature=r.temperature,
                scope=functools.partial(adapters_disabled, actor_model),
            )
        elif a.needs_ref:
            ref_path = m.ref_path or m.path
            with timed(self.startup_seconds, "reference", self.device):
                ref_model = self._build(
                    lambda: CausalLM(model_config or ArchConfig.from_dir(ref_path), self.ops),
                    ref_path,
                    REFERENCE,
                    train=False,
                    pin=True,
                )
                self.reference = Reference(ref_model, self.memory, REFERENCE, temperature=r.temperature)
                self.memory.offload(REFERENCE)

        self.critic = None
        if a.use_critic:
            critic_path = m.critic_path or m.path
            critic_cfg = model_config or ArchConfig.from_dir(critic_path)
            with timed(self.startup_seconds, "critic", self.device):
                critic_model = self._build(
                    lambda: ValueModel(critic_cfg, self.ops),
                    critic_path,
                    CRITIC_PARAMS,
                    train=True,
                    skip=("lm_head.",),
                    new=("value_head.",),
                    forward_methods=(),
                    lora=self.lora,
                    adapt=add_critic_adapters,
                    pin=cfg.offload.offload_train,
                )
                critic_opt, critic_arrival = self._optimizer(
                    critic_model, t.critic_lr, CRITIC_OPTIM, max(1, t.num_rollout * steps_per_rollout)
                )
            self.critic = Critic(critic_model, critic_opt, critic_arrival, a, norm_len=norm_len, keep_gathered=self.keep_gathered)

    def _plan_memory(self, policy_cfg: ArchConfig, checkpointing: ActivationCheckpointing | None) -> MemoryPlan:
        """Resolve cfg's `auto` sizes in place from the device's free memory (colocate/sizing.py),
        before anything is loaded; every rank plans for the one with the least free memory."""
        m, t = self.cfg.model, self.cfg.train
        modes = None
        if checkpointing is not None:
            modes = tuple(checkpointing.block_modes(policy_cfg.num_hidden_layers))
        elif m.recompute_rest != AUTO or m.full_recompute_fraction > 0:
            rest = "none" if m.recompute_rest == AUTO else m.recompute_rest
            plan = ActivationCheckpointing(m.full_recompute_fraction, rest, m.recompute_keeps_attention)
            modes = tuple(plan.block_modes(policy_cfg.num_hidden_layers))
        itemsize = self.compute_dtype.itemsize
        needs = needs_of(self.cfg, self.info.world_size, itemsize, self.keep_gathered, modes)
        if self.device.type != "cuda":
            plan = cpu_plan(needs)
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            free = -dist.all_reduce_max(-free, self.device)
            p = policy_cfg
            kv_dtype = torch.float8_e4m3fn if self.cfg.rollout.kv_cache_dtype == "fp8_e4m3" else self.compute_dtype
            kv_per_token = p.num_hidden_layers * kv_bytes_per_token(p.num_key_value_heads, p.head_dim, kv_dtype)
            shape = Shape.of(policy_cfg, m.lora_rank, tuple(m.lora_target_modules))
            plan = plan_memory(shape, needs, free, total, kv_per_token)
        t.max_tokens_per_gpu = plan.max_tokens_per_gpu
        if m.recompute_rest == AUTO:
            m.recompute_rest = plan.recompute_rest or "none"
        return plan

    def _build(
        self,
        make,
        path: str,
        tag: str,
        *,
        train: bool,
        skip: tuple[str, ...] = (),
        new: tuple[str, ...] = (),
        forward_methods: tuple[str, ...] = ("hidden_states",),
        lora: LoRASpec | None = None,
        adapt=add_adapters,
        pin: bool = False,
    ) -> nn.Module:
        """Trained models keep fp32 master shards and compute in the compute dtype; the frozen
        reference, and the frozen base under `lora` adapters (fp32 masters, added by `adapt`),
        store their shards in the compute dtype directly. With `pin` the model's host buffers
        start pinning once its shards are allocated, while its weights load."""
        mixed = self.compute_dtype if self.compute_dtype != torch.float32 else None

        def allocated(model: nn.Module) -> None:
            self.memory.add_model(tag, model, keep_trained=self._keeps_adapters(lora))
            if pin:
                self._reserve(tag)

        model, missing = build_sharded(
            make,
            self.mesh,
            self.device,
            dtype=torch.float32 if train and lora is None else self.compute_dtype,
            param_dtype=mixed if train else None,
            adapt=None if lora is None else functools.partial(adapt, spec=lora),
            random=lora is not None and lora.dropout > 0,
            weights=None if self.random_config is not None else iter_safetensors(path),
            source=str(path),
            skip=skip,
            checkpointing=self.checkpointing if train else ActivationCheckpointing(),
            compile=bool(self.cfg.model.compile),
            forward_methods=forward_methods,
            reshard_after_forward=not (train and self.keep_gathered),
            region=self.memory.region(tag),
            seed=self.cfg.train.seed,
            allocated=allocated,
        )
        unexpected = sorted(n for n in missing if not n.startswith(new) and not is_adapter(n))
        if unexpected:
            raise ValueError(f"{path}: missing tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if missing and isinstance(model, ValueModel):
            zero_value_head_(model)
        if lora is not None:
            init_adapters_(model, self.cfg.train.seed)
        return model

    def _reserve(self, tag: str) -> None:
        """Start pinning a group's host buffers on helper threads (colocate/trainer/memory.py)."""
        seconds = self.memory.reserve(tag)
        if self.device.type == "cuda":
            self.startup_seconds["pinned_buffers"] = self.startup_seconds.get("pinned_buffers", 0.0) + seconds

    def _keeps_adapters(self, lora: LoRASpec | None) -> bool:
        """LoRA's trained tensors stay on the device through generation (offload.keep_adapters;
        "tms" pauses a model's region whole)."""
        o = self.cfg.offload
        return lora is not None and o.keep_adapters and o.method == "pinned"

    def _optimizer(self, model: nn.Module, lr: float, tag: str, total_steps: int) -> tuple[OptimizerStep, StateArrival]:
        t = self.cfg.train
        schedule = LRSchedule(t.lr_schedule, t.lr_warmup_steps, total_steps, t.min_lr_ratio)
        opt = OptimizerStep(
            model,
            lr=lr,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            weight_decay=t.weight_decay,
            grad_clip=t.grad_clip,
            schedule=schedule,
            max_skipped_steps=t.max_skipped_steps,
            lr_field="train.critic_lr" if tag == CRITIC_OPTIM else "train.lr",
        )
        with self.memory.region(tag):
            init_optimizer_state(opt.optimizer)
        arrival = self.memory.add_optimizer(tag, opt, model, keep=self._keeps_adapters(self.lora))
        if self.cfg.offload.offload_train:
            self._reserve(tag)
        return opt, arrival

    @property
    def actor_module(self) -> nn.Module:
        """The FSDP2 policy (HF parameter names), for the weight sync."""
        return self.actor.model

    def train(self, samples: list[Sample], rollout_id: int, weight_version: int | None = None) -> dict[str, float]:
        """Train on this rank's samples (whole groups) of one rollout step; `weight_version` is the
        version of the weights being trained (rollout.partial_mask_stale_tokens masks older tokens).

        Returns metrics over the global batch, the same on every rank, except the perf/*_time
        phase durations, which are this rank's. train/loss_free_samples counts the samples with
        every token masked, which no pass ran (colocate/trainer/passes.py): their old and reference
        log-probs and values stay 0, read by nothing but masked terms.
        """
        cfg, a = self.cfg, self.cfg.algorithm
        t = cfg.train
        metrics: dict[str, float] = {}
        r = cfg.rollout
        stale_before = weight_version if r.partial_rollout and r.partial_mask_stale_tokens else None
        with record_function("train.prepare"):
            batch = RolloutBatch.from_samples(samples, self.device, vocab_size=self.vocab_size, stale_before=stale_before)
            per_rank = t.global_batch_size // self.info.world_size if t.global_batch_size else None
            plans = plan_steps(batch, t.max_tokens_per_gpu, per_rank)
            parts = pass_parts(batch, t.max_tokens_per_gpu)
        metrics["train/loss_free_samples"] = sum(p.num_skipped for p in plans)
        actor_trains = not (a.use_critic and rollout_id < a.num_critic_only_steps)
        if a.kl_in_reward or (actor_trains and len(plans) > 1):
            with timed(metrics, "perf/old_logprob_time", self.device):
                batch["old_logprobs"] = self.actor.logprobs(batch, parts)
        if self.reference is not None:
            with timed(metrics, "perf/ref_logprob_time", self.device):
                batch["ref_logprobs"] = self.reference.logprobs(batch, parts)
            if self.reference.last_onload.num_bytes:
                metrics["perf/ref_onload_gb_per_s"] = self.reference.last_onload.gb_per_s
        if self.critic is not None:
            with timed(metrics, "perf/values_time", self.device):
                batch["values"] = self.critic.values(batch, parts)
        compute_advantages(batch, a, cfg.rollout.n_samples_per_prompt)
        metrics["train/advantage_mean"] = global_masked_mean(batch["advantages"], batch.mask)
        if self.critic is not None:
            with timed(metrics, "perf/critic_train_time", self.device):
                metrics.update(_summarize(self.critic.train(batch, plans), "critic/"))
        if actor_trains:
            with timed(metrics, "perf/actor_train_time", self.device):
                steps, num_tokens = self.actor.train(batch, plans)
            metrics.update(_summarize(steps, "train/"))
            total_tokens = float(dist.all_reduce_sum([num_tokens], self.device)[0])
            metrics["perf/train_tokens_per_s"] = total_tokens / max(metrics["perf/actor_train_time"], 1e-9)
        self.memory.settle()
        return metrics

    def checkpoint_states(self) -> dict:
        """Stateful parts for colocate.checkpoint (DCP): the actor as "model", the critic as "critic".
        With LoRA each part holds its adapters (and the critic's value head), their optimizer
        state and which base they fit."""
        from colocate.checkpoint import ACTOR_STATE, ModelOptimizerState

        m = self.cfg.model
        describe = (lambda base: None) if self.lora is None else self.lora.describe
        opt = self.actor.opt
        states = {ACTOR_STATE: ModelOptimizerState(self.actor.model, opt.optimizer, opt.scheduler, adapters=describe(m.path))}
        if self.critic is not None:
            c = self.critic.opt
            states["critic"] = ModelOptimizerState(
                self.critic.model, c.optimizer, c.scheduler, adapters=describe(m.critic_path or m.path)
            )
        return states
