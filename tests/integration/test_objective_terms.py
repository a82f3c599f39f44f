"""Every term of the training objective, checked for its effect on the trainer's gradients and weights.

One rollout of three groups trains in three optimizer steps (one group each), with the old
log-probs taken before the first: from the second step on the ratios are away from 1, so the PPO
clip, clip-higher and the dual clip act. The objective is written out here in plain torch from the
docstrings of colocate/algo (losses, advantages), not by calling it; its gradient and the AdamW
update that follows are compared with the trainer's at every step, for the actor and the critic.
Each test also checks that leaving out any one term (policy gradient, KL loss, KL in the reward,
entropy bonus, TIS weights and their truncation, MIS mask, PPO clip, clip-higher, dual clip, value
clip) moves the reference gradient far beyond the tolerance, so a trainer that zeroes or flips it
cannot pass. GSPO and CISPO runs check those objectives; one more run sets every optimizer setting
(learning rates, schedule, betas, clipping), the MIS bounds and the critic's aggregation away from
their defaults, so that a trainer that drops one of them fails too.
"""

from __future__ import annotations

import functools
import math
import shutil

import pytest
import torch
from torch import nn

from colocate.config import Config
from colocate.models import from_pretrained
from colocate.rollout.sample import Sample
from tests.helpers import write_hf_model

GROUP, NUM_GROUPS, TEMPERATURE, MAX_RESPONSE_LEN = 4, 3, 0.7, 16
ATOL = 1e-5
"""Trainer vs plain torch, gradients and weights (fp32)."""
EFFECT = 30 * ATOL
"""Least change of a step's gradient that leaving out one term must cause."""
TERMS = ("pg", "kl_loss", "kl_reward", "entropy", "tis", "tis_clip", "mis", "clip", "clip_high", "dual_clip")

COMMON = {
    "algorithm.eps_clip": 0.02,
    "algorithm.eps_clip_high": 0.4,
    "algorithm.dual_clip_c": 1.15,
    "algorithm.use_kl_loss": True,
    "algorithm.kl_loss_coef": 0.5,
    "algorithm.kl_in_reward": True,
    "algorithm.kl_reward_coef": 0.3,
    "algorithm.entropy_coef": 0.05,
    "algorithm.use_tis": True,
    "algorithm.tis_clip": 1.2,
    "algorithm.use_mis": True,
    "algorithm.mis_low": 0.5,
    "algorithm.mis_high": 2.0,
}
CASES = {
    "k1_token_mean": {"algorithm.kl_estimator": "k1", "algorithm.loss_agg_mode": "token_mean"},
    "k2_seq_mean_token_mean": {"algorithm.kl_estimator": "k2", "algorithm.loss_agg_mode": "seq_mean_token_mean"},
    "k3_seq_mean_token_sum": {"algorithm.kl_estimator": "k3", "algorithm.loss_agg_mode": "seq_mean_token_sum"},
    "low_var_kl_gae": {
        "algorithm.kl_estimator": "low_var_kl",
        "algorithm.loss_agg_mode": "token_mean",
        "algorithm.advantage_estimator": "gae",
        "algorithm.gamma": 0.9,
        "algorithm.lam": 0.8,
        "algorithm.value_clip": 0.05,
    },
}
SEQUENCE_LOSSES = {"gspo": ("dual_clip", "clip_high"), "cispo": ("dual_clip",)}
"""GSPO and CISPO, run on the settings of COMMON but the dual clip (PPO's only), and the terms
that do not act in their run: no sequence ratio of GSPO's reaches the clip-higher range."""
SETTINGS = {
    "train.critic_lr": 0.01,
    "train.adam_beta1": 0.7,
    "train.adam_beta2": 0.5,
    "train.grad_clip": 0.05,
    "train.lr_schedule": "cosine",
    "train.lr_warmup_steps": 0,
    "train.min_lr_ratio": 0.3,
    "algorithm.advantage_estimator": "gae",
    "algorithm.gamma": 0.9,
    "algorithm.lam": 0.8,
    "algorithm.value_clip": 0.3,
    "algorithm.kl_estimator": "k2",
    "algorithm.loss_agg_mode": "seq_mean_token_sum",
    "algorithm.mis_low": 0.85,
    "algorithm.mis_high": 2.35,
    "algorithm.dual_clip_c": 1.04,
}
"""Every setting of the AdamW step away from its default (critic_lr away from lr), a clip that
every step's gradient exceeds, and MIS bounds that keep or drop samples that the default bounds
would not: the engine ratios of _samples put one sequence at 2.33 and one at 2.37, two at 0.78
and 0.80. The clipped steps move the ratios by less than 10%, hence a dual clip bound that close to 1;
over three steps only a beta2 far below 1 changes the bias-corrected second moment much."""


def _config(paths: dict, overrides: dict) -> Config:
    cfg = Config()
    m, r, t = cfg.model, cfg.rollout, cfg.train
    m.path, m.ref_path, m.critic_path = (str(paths[k]) for k in ("policy", "ref", "critic"))
    m.dtype = "float32"
    r.rollout_batch_size, r.n_samples_per_prompt, r.max_response_len, r.temperature = (
        NUM_GROUPS,
        GROUP,
        MAX_RESPONSE_LEN,
        TEMPERATURE,
    )
    # A large Adam epsilon keeps the update smooth in the gradient, so the weights can be held to
    # the gradients' tolerance; two warm-up steps put the schedule in the comparison.
    t.lr, t.critic_lr, t.adam_eps, t.weight_decay, t.grad_clip = 0.02, 0.02, 1e-2, 0.1, 1e6
    t.lr_warmup_steps, t.global_batch_size, t.max_tokens_per_gpu, t.num_rollout = 2, GROUP, 24, 1
    for dotted, value in {**COMMON, **overrides}.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Policy and reference: two different tiny Qwen2 models; the critic starts from the policy's
    backbone with a random value head (so its values are not all 0 at the start)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("models")
    policy, hf = write_hf_model(root / "policy", "qwen2", seed=0, initializer_range=0.1)
    ref, _ = write_hf_model(root / "ref", "qwen2", seed=1, initializer_range=0.1)
    critic = root / "critic"
    shutil.copytree(policy, critic)
    g = torch.Generator().manual_seed(2)
    save_file(
        {"value_head.weight": torch.randn(1, hf.config.hidden_size, generator=g) * 0.3, "value_head.bias": torch.tensor([0.2])},
        critic / "value_head.safetensors",
    )
    return {"policy": policy, "ref": ref, "critic": critic}


def _predictors(sample: Sample) -> tuple[torch.Tensor, slice]:
    """The sample's tokens and the positions whose outputs predict its n response tokens."""
    return torch.tensor(sample.tokens), slice(len(sample.prompt_ids) - 1, -1)


def _response_stats(model, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (n,) and entropies (n,) of the response tokens at TEMPERATURE."""
    tokens, rows = _predictors(sample)
    logp = torch.log_softmax(model(tokens)[rows] / TEMPERATURE, dim=-1)  # (n, V)
    lp = logp.gather(1, torch.tensor(sample.response_ids)[:, None]).squeeze(1)
    return lp, -(logp.exp() * logp).sum(-1)


def _samples(policy_path) -> list[Sample]:
    """Groups with uneven lengths, one tool-output token per sample, and engine log-probs that
    differ from the policy's: by noise (some TIS weights truncated) and, for the last sample of
    each group, by a shift that puts its MIS ratio out of [0.5, 2], below and above in turn."""
    model = from_pretrained(policy_path, dtype="float32")
    g = torch.Generator().manual_seed(0)
    out = []
    for group in range(NUM_GROUPS):
        prompt = torch.randint(2, 101, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        for j in range(GROUP):
            n = int(torch.randint(3, 10, (1,), generator=g))
            response = torch.randint(2, 101, (n,), generator=g).tolist()
            s = Sample(
                prompt,
                response,
                [0.0] * n,
                [0 if k == 1 else 1 for k in range(n)],
                group,
                j,
                reward=float(torch.rand(1, generator=g)),
            )
            with torch.no_grad():
                lp, _ = _response_stats(model, s)
            shift = (1.0 if group % 2 else -1.0) if j == GROUP - 1 else 0.0
            s.rollout_logprobs = (lp + shift + 0.3 * torch.randn(n, generator=g)).tolist()
            out.append(s)
    return out


def _recorder(trainer, part: str) -> list[dict]:
    """Per optimizer step of trainer.<part>: full weights before it, gradients, weights after."""
    owner = getattr(trainer, part)
    names = {id(p): n for n, p in owner.model.named_parameters()}
    steps: list[dict] = []

    def full(p):
        return p.detach().full_tensor().clone()

    def before(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps.append(
            {
                "before": {names[id(p)]: full(p) for p in params},
                "grads": {names[id(p)]: p.grad.full_tensor().clone() for p in params},
            }
        )

    def after(optimizer, args, kwargs):
        steps[-1]["after"] = {names[id(p)]: full(p) for group in optimizer.param_groups for p in group["params"]}

    owner.opt.optimizer.register_step_pre_hook(before)
    owner.opt.optimizer.register_step_post_hook(after)
    return steps


@pytest.fixture(scope="module")
def samples(paths):
    return _samples(paths["policy"])


@pytest.fixture(scope="module")
def one_rank():
    """A gloo group of one rank in this process (a spawned rank would spend longer importing
    than training), with one intra-op thread: for tiny models a second one only waits."""
    import torch.distributed as tdist

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()
    torch.set_num_threads(threads)


def _train(cfg, samples) -> tuple[list[dict], list[dict] | None]:
    """The recorded optimizer steps of the actor and (with gae) the critic over one rollout."""
    from colocate import dist
    from colocate.trainer import Trainer

    trainer = Trainer(cfg, dist.get_info())
    actor = _recorder(trainer, "actor")
    critic = _recorder(trainer, "critic") if trainer.critic is not None else None
    trainer.train(samples, rollout_id=0)
    return actor, critic


# ---------------------------------------------------------------- the objective in plain torch


def _kl(lp, ref, kind):
    d = ref - lp
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(d) - d - 1
    d = d.clamp(-20, 20)
    return (torch.exp(d) - d - 1).clamp(-10, 10)


def _aggregate(per_sample: list, masks: list, mode: str) -> torch.Tensor:
    """The step's loss from per-sample token losses: denominators are the step's masked tokens
    (token_mean) or samples (the sequence means; seq_mean_token_sum divides by max_response_len too)."""
    if mode == "token_mean":
        return sum((x * m).sum() for x, m in zip(per_sample, masks)) / sum(m.sum() for m in masks)
    if mode == "seq_mean_token_mean":
        return sum((x * m).sum() / m.sum() for x, m in zip(per_sample, masks)) / len(masks)
    return sum((x * m).sum() for x, m in zip(per_sample, masks)) / (len(masks) * MAX_RESPONSE_LEN)


def _gae(rewards, values, mask, gamma, lam):
    """Advantages and returns of one sample over its masked tokens (V after the last one is 0)."""
    steps = [t for t in range(len(mask)) if mask[t] > 0]
    adv, ret = torch.zeros(len(mask)), torch.zeros(len(mask))
    next_value, next_adv = 0.0, 0.0
    for t in reversed(steps):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        adv[t], ret[t], next_value = next_adv, next_adv + values[t], values[t]
    return adv, ret


class _Inputs:
    """What the objective reads besides the current weights, per sample ((n,) tensors): the mask,
    old / reference / rollout log-probs, the critic's values, and the advantages and returns with
    and without the KL penalty in the reward."""

    def __init__(self, samples, algo, old_model, ref_model, critic=None):
        with torch.no_grad():
            self.old = [_response_stats(old_model, s)[0] for s in samples]
            self.ref = [_response_stats(ref_model, s)[0] for s in samples]
            self.values = [critic(s) for s in samples] if critic is not None else None
        self.mask = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
        self.rollout = [torch.tensor(s.rollout_logprobs) for s in samples]
        self.samples, self.algo = samples, algo
        self.adv, self.returns = self._advantages(algo.kl_reward_coef)
        self.adv_without_kl_reward, _ = self._advantages(0.0)

    def _advantages(self, kl_coef: float) -> tuple[list, list | None]:
        algo = self.algo
        penalty = [kl_coef * _kl(o, r, algo.kl_estimator) * m for o, r, m in zip(self.old, self.ref, self.mask)]
        if algo.advantage_estimator == "grpo":
            rewards = torch.tensor([s.reward - float(p.sum()) for s, p in zip(self.samples, penalty)])
            grouped = rewards.view(-1, GROUP)
            seq_adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
            return [a * m for a, m in zip(seq_adv.view(-1), self.mask)], None
        assert algo.advantage_estimator == "gae"
        adv, returns = [], []
        for s, p, v, m in zip(self.samples, penalty, self.values, self.mask):
            token_rewards = -p
            token_rewards[max(t for t in range(len(m)) if m[t] > 0)] += s.reward
            a, r = _gae(token_rewards, v, m, algo.gamma, algo.lam)
            adv.append(a)
            returns.append(r)
        flat, m = torch.cat(adv), torch.cat(self.mask)
        mean = (flat * m).sum() / m.sum()
        std = torch.sqrt(((flat - mean) ** 2 * m).sum() / m.sum() + 1e-8)
        return [(a - mean) / std * mk for a, mk in zip(adv, self.mask)], returns


def _policy_loss(model, inputs: _Inputs, idx: list[int], drop: str | None = None) -> torch.Tensor:
    """The actor's loss on samples `idx` (one optimizer step), with term `drop` left out."""
    algo = inputs.algo
    lo, hi = 1 - algo.eps_clip, 1 + (algo.eps_clip if drop == "clip_high" else algo.eps_clip_high)
    advantages = inputs.adv_without_kl_reward if drop == "kl_reward" else inputs.adv
    pg, kl, ent, masks = [], [], [], []
    for i in idx:
        lp, entropy = _response_stats(model, inputs.samples[i])
        old, adv, m = inputs.old[i], advantages[i], inputs.mask[i]
        ratio = torch.exp(lp - old)
        if algo.policy_loss == "gspo":  # the sequence's geometric-mean ratio, lp's gradient per token
            ratio = torch.exp(((lp - old) * m).sum() / m.sum()).detach() * torch.exp(lp - lp.detach())
        if algo.policy_loss == "cispo":  # the clipped ratio weighs a REINFORCE term
            weight = ratio.detach() if drop == "clip" else ratio.detach().clamp(lo, hi)
            loss = -weight * adv * lp
        else:
            loss = -adv * ratio if drop == "clip" else torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
        if algo.dual_clip_c is not None and drop != "dual_clip":
            loss = torch.where((adv < 0) & (loss > -algo.dual_clip_c * adv), -algo.dual_clip_c * adv, loss)
        weights = torch.exp(old - inputs.rollout[i]).clamp(max=math.inf if drop == "tis_clip" else algo.tis_clip)
        if drop != "tis":
            loss = loss * weights
        rho = math.exp(float(((old - inputs.rollout[i]) * m).sum() / m.sum()))
        kept = 1.0 if drop == "mis" or algo.mis_low <= rho <= algo.mis_high else 0.0
        pg.append(loss * kept)
        kl.append(_kl(lp, inputs.ref[i], algo.kl_estimator) * kept)
        ent.append(entropy * kept)
        masks.append(m)
    mode = algo.loss_agg_mode
    total = 0.0 if drop == "pg" else _aggregate(pg, masks, mode)
    if drop != "kl_loss":
        total = total + algo.kl_loss_coef * _aggregate(kl, masks, mode)
    if drop != "entropy":
        total = total - algo.entropy_coef * _aggregate(ent, masks, mode)
    return total


def _value_loss(critic, inputs: _Inputs, idx: list[int], drop: str | None = None) -> torch.Tensor:
    """The critic's clipped value loss on samples `idx`, without the clip if `drop` says so."""
    algo = inputs.algo
    losses, masks = [], []
    for i in idx:
        v, old, ret = critic(inputs.samples[i]), inputs.values[i], inputs.returns[i]
        clipped = old + (v - old).clamp(-algo.value_clip, algo.value_clip)
        loss = torch.maximum((v - ret) ** 2, (clipped - ret) ** 2) if drop != "value_clip" else (v - ret) ** 2
        losses.append(0.5 * loss)
        masks.append(inputs.mask[i])
    return _aggregate(losses, masks, algo.loss_agg_mode)


class _PlainCritic(nn.Module):
    """A policy's backbone (HF `model.` names) and the value head of the critic's directory."""

    def __init__(self, lm, critic_dir):
        from safetensors.torch import load_file

        super().__init__()
        self.lm = [lm]  # a list, not a submodule: only the backbone's parameters are the critic's
        self.model = lm.model
        self.value_head = nn.Linear(lm.config.hidden_size, 1)
        self.value_head.load_state_dict(
            {k.removeprefix("value_head."): v for k, v in load_file(critic_dir / "value_head.safetensors").items()}
        )

    def forward(self, sample: Sample) -> torch.Tensor:
        tokens, rows = _predictors(sample)
        return self.value_head(self.lm[0].hidden_states(tokens)[rows]).squeeze(-1)  # (n,)


def _load(module: nn.Module, weights: dict) -> nn.Module:
    params = dict(module.named_parameters())
    assert set(params) == set(weights)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    return module


def _grads(module: nn.Module, loss: torch.Tensor) -> dict:
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


class _AdamW:
    """torch.optim.AdamW's documented update, decaying matrices only, at the learning rate of
    LRSchedule's docstring over the run's NUM_GROUPS steps: lr (s + 1) / warmup_steps at step s in
    the warm-up, then lr times the constant, linear or cosine decay to min_lr_ratio. `clipped`
    scales gradients to the global norm grad_clip."""

    def __init__(self, t, lr: float):
        self.t, self.lr, self.step, self.m, self.v = t, lr, 0, {}, {}

    def _lr(self) -> float:
        t, s = self.t, self.step
        if s < t.lr_warmup_steps:
            return self.lr * (s + 1) / t.lr_warmup_steps
        p = min(1.0, (s - t.lr_warmup_steps) / max(1, NUM_GROUPS - t.lr_warmup_steps))
        decay = {"constant": 1.0, "linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p))}[t.lr_schedule]
        r = 1.0 if t.lr_schedule == "constant" else t.min_lr_ratio
        return self.lr * (r + (1 - r) * decay)

    def clipped(self, grads: dict) -> dict:
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        scale = min(1.0, self.t.grad_clip / norm)
        return {name: g * scale for name, g in grads.items()}

    def __call__(self, weights: dict, grads: dict) -> dict:
        t = self.t
        lr = self._lr()
        b1, b2 = t.adam_beta1, t.adam_beta2
        self.step += 1
        out = {}
        for name, w in weights.items():
            g = grads[name]
            self.m[name] = b1 * self.m.get(name, 0.0) + (1 - b1) * g
            self.v[name] = b2 * self.v.get(name, 0.0) + (1 - b2) * g * g
            m_hat, v_hat = self.m[name] / (1 - b1**self.step), self.v[name] / (1 - b2**self.step)
            decayed = w * (1 - lr * t.weight_decay) if w.ndim >= 2 else w
            out[name] = decayed - lr * m_hat / (v_hat.sqrt() + t.adam_eps)
        return out


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _check_steps(steps: list[dict], module: nn.Module, loss_fn, terms, adam: _AdamW) -> list[float]:
    """Each recorded optimizer step against plain torch at the trainer's weights before it: the
    (clipped) gradient and the updated weights. Leaving out any one of `terms` must change the
    gradient of at least one step: a trainer without that term follows the same weights up to
    that step, so it fails there. `loss_fn(sample indices, term left out or None)` is the step's
    loss. Returns each step's gradient norm before clipping."""
    effects = dict.fromkeys(terms, 0.0)
    norms = []
    assert len(steps) == NUM_GROUPS
    for k, step in enumerate(steps):
        idx = list(range(k * GROUP, (k + 1) * GROUP))
        _load(module, step["before"])
        raw = _grads(module, loss_fn(idx, None))
        norms.append(math.sqrt(sum(float(g.square().sum()) for g in raw.values())))
        expected = adam.clipped(raw)
        assert _max_diff(step["grads"], expected) <= ATOL, f"step {k}: gradient"
        for term in terms:
            effects[term] = max(effects[term], _max_diff(raw, _grads(module, loss_fn(idx, term))))
        assert _max_diff(step["after"], adam(step["before"], expected)) <= ATOL, f"step {k}: updated weights"
    assert all(e > EFFECT for e in effects.values()), effects
    return norms


def _check_run(cfg, paths, samples, terms=TERMS) -> tuple[list[float], list[float] | None]:
    """Train one rollout with `cfg` and check every actor (and critic) step against plain torch,
    and the effect of each of the actor's `terms`; returns the gradient norms before clipping of
    the actor's and the critic's steps."""
    actor, critic_steps = _train(cfg, samples)
    load = functools.partial(from_pretrained, dtype="float32")
    policy = load(paths["policy"])
    assert _max_diff(actor[0]["before"], {n: p.detach() for n, p in policy.named_parameters()}) == 0.0
    critic, critic_norms = None, None
    if cfg.algorithm.use_critic:  # it starts from critic_path, value head included
        critic = _PlainCritic(load(paths["policy"]), paths["critic"])
        assert _max_diff(critic_steps[0]["before"], {n: p.detach() for n, p in critic.named_parameters()}) == 0.0
    else:
        assert critic_steps is None
    inputs = _Inputs(samples, cfg.algorithm, policy, load(paths["ref"]), critic)
    if critic is not None:  # the critic trains first, on the values read before its first step
        critic_norms = _check_steps(
            critic_steps,
            critic,
            functools.partial(_value_loss, critic, inputs),
            ("value_clip",),
            _AdamW(cfg.train, cfg.train.critic_lr),
        )
    model = load(paths["policy"])
    actor_norms = _check_steps(
        actor, model, functools.partial(_policy_loss, model, inputs), terms, _AdamW(cfg.train, cfg.train.lr)
    )
    return actor_norms, critic_norms


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_follows_the_documented_objective(case, paths, samples, one_rank):
    _check_run(_config(paths, CASES[case]), paths, samples)


@pytest.mark.parametrize("kind", list(SEQUENCE_LOSSES))
def test_trainer_follows_the_gspo_and_cispo_objectives(kind, paths, samples, one_rank):
    cfg = _config(paths, {"algorithm.policy_loss": kind, "algorithm.dual_clip_c": None, "algorithm.kl_estimator": "k1"})
    _check_run(cfg, paths, samples, tuple(t for t in TERMS if t not in SEQUENCE_LOSSES[kind]))


def test_trainer_follows_the_optimizer_and_mis_settings(paths, samples, one_rank):
    cfg = _config(paths, SETTINGS)
    assert cfg.train.critic_lr != cfg.train.lr
    actor_norms, critic_norms = _check_run(cfg, paths, samples)
    # Every step is clipped, by far more than the tolerance could hide.
    assert min(actor_norms + critic_norms) > 2 * cfg.train.grad_clip, (actor_norms, critic_norms)
