"""The FSDP2 trainer on CPU (gloo): exactness across ranks and micro-batch budgets, first-step
invariants, skipped steps, the critic, the reference model, resuming from a checkpoint.

Starting a process costs seconds, so every single-process scenario runs in one spawned process
(the `one_rank` fixture) and the tests assert on what it recorded."""

import math

import pytest
import torch

from colocate.config import Config
from colocate.models import from_pretrained
from colocate.rollout.sample import Sample
from colocate.trainer.memory import PARAMS, STATE
from tests.distributed import run_ranks
from tests.helpers import capture_grads, write_hf_model

GROUP = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A tiny Qwen2 (tied embeddings, q/k/v biases) shared by the tests of this file."""
    path, _ = write_hf_model(tmp_path_factory.mktemp("model"), "qwen2")
    return path


def _config(path, **overrides) -> Config:
    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(path), "float32"
    r, t = cfg.rollout, cfg.train
    r.rollout_batch_size, r.n_samples_per_prompt, r.max_response_len, r.temperature = 2, GROUP, 16, 1.0
    # A large Adam epsilon makes the update smooth in the gradient (not sign-like), so weight
    # comparisons after one step are as tight as the gradient comparisons.
    t.lr, t.adam_eps, t.weight_decay, t.grad_clip, t.max_tokens_per_gpu = 1e-3, 1e-2, 0.01, 1e6, 48
    t.num_rollout = 4
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _samples(vocab: int, num_groups: int = 2, seed: int = 0) -> list[Sample]:
    """Groups of GROUP samples with uneven prompt/response lengths and some masked-out tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(num_groups):
        prompt = torch.randint(2, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        for j in range(GROUP):
            n = int(torch.randint(2, 10, (1,), generator=g))
            response = torch.randint(2, vocab, (n,), generator=g).tolist()
            mask = [0 if k == 1 else 1 for k in range(n)]  # one tool-output token per sample
            out.append(Sample(prompt, response, [-2.0] * n, mask, group, j, reward=float(torch.rand(1, generator=g))))
    return out


def _weights(trainer) -> dict:
    return {n: p.full_tensor().clone() for n, p in trainer.actor_module.named_parameters()}


def _modes(path, samples, rank, world_size) -> dict:
    """Gradients, updated weights and metrics of one step under each aggregation mode."""
    from colocate import dist
    from colocate.trainer import Trainer

    per_rank = len(samples) // world_size
    local = samples[rank * per_rank : (rank + 1) * per_rank]
    results = {}
    for mode in ("token_mean", "seq_mean_token_mean"):
        trainer = Trainer(_config(path, **{"algorithm.loss_agg_mode": mode}), dist.get_info())
        grads = capture_grads(trainer)
        metrics = trainer.train(local, rollout_id=0)
        results[mode] = (grads, _weights(trainer), metrics)
    # Uneven ranks (3 groups vs 1) and a small budget: the lighter rank runs empty micro-batches.
    # Once more with parameters kept gathered and gradients reduced once per step (the default
    # with one rank, where both runs take that path).
    groups = _samples(vocab=101, num_groups=4, seed=2)
    local = groups if world_size == 1 else (groups[: 3 * GROUP] if rank == 0 else groups[3 * GROUP :])
    for name, keep in (("uneven", None), ("uneven_gathered", True)):
        trainer = Trainer(_config(path, **{"train.max_tokens_per_gpu": 16, "train.keep_gathered": keep}), dist.get_info())
        grads = capture_grads(trainer)
        metrics = trainer.train(local, rollout_id=0)
        results[name] = (grads, _weights(trainer), metrics)
    return results


def _two_ranks(rank, world_size, path, out_file):
    torch.set_num_threads(1)  # tiny models: extra intra-op threads only fight over the cores
    results = _modes(path, _samples(vocab=101), rank, world_size)
    if rank == 0:
        torch.save(results, out_file)


def _budgets(path, info) -> list[dict]:
    from colocate.trainer import Trainer

    samples = _samples(vocab=101, num_groups=3, seed=1)
    results = []
    # One micro-batch vs. about one sample per micro-batch, the latter with every block recomputed,
    # and middle budgets with half the blocks recomputed (keeping attention's output) and the rest
    # recomputing element-wise ops (and the gate/up projections).
    half = {"model.recompute_fraction": 0.5, "model.recompute_keeps_attention": True}
    plans = (
        (4096, {}, ["none"] * 2),
        (16, {"model.gradient_checkpointing": True}, ["full"] * 2),
        (64, {**half, "model.recompute_rest": "ops"}, ["attention", "ops"]),
        (32, {**half, "model.recompute_rest": "mlp"}, ["attention", "mlp"]),
    )
    for budget, recompute, block_modes in plans:
        trainer = Trainer(_config(path, **{"train.max_tokens_per_gpu": budget, **recompute}), info)
        assert trainer.checkpointing.block_modes(2) == block_modes
        grads = capture_grads(trainer)
        trainer.train(samples, rollout_id=0)
        results.append(grads)
    return results


def _plain_logprobs(path, samples, temperature):
    """Behaviour log-probs from the plain model, as an engine would report them."""
    model = from_pretrained(path, dtype="float32")
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor(s.tokens)) / temperature  # (L, V)
            logp = torch.log_softmax(logits, dim=-1)[len(s.prompt_ids) - 1 : -1]
            s.rollout_logprobs = logp.gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1).tolist()


def _first_steps(path, info) -> dict:
    from colocate.trainer import Trainer

    samples = _samples(vocab=101)
    _plain_logprobs(path, samples, temperature=0.7)
    out = {}
    for name, gbs in (("one_step", None), ("two_steps", 4)):
        cfg = _config(path, **{"rollout.temperature": 0.7, "train.global_batch_size": gbs})
        out[name] = Trainer(cfg, info).train(samples, rollout_id=0)
    return out


def _nan_reward(path, info) -> dict:
    from colocate.trainer import Trainer

    trainer = Trainer(_config(path), info)
    before = _weights(trainer)
    samples = _samples(vocab=101)
    samples[0].reward = float("nan")
    skipped = trainer.train(samples, rollout_id=0)
    after_skip = _weights(trainer)
    clean = trainer.train(_samples(vocab=101), rollout_id=1)
    return dict(before=before, after_skip=after_skip, after_clean=_weights(trainer), skipped=skipped, clean=clean)


def _critic(path, info) -> dict:
    from colocate.trainer import Trainer

    cfg = _config(
        path,
        **{
            "algorithm.advantage_estimator": "gae",
            "algorithm.num_critic_only_steps": 2,
            "train.critic_lr": 2e-3,
            "algorithm.value_clip": 10.0,
            "algorithm.lam": 1.0,
        },
    )
    trainer = Trainer(cfg, info)
    samples = _samples(vocab=101)
    weights, metrics = [_weights(trainer)], []
    for rollout_id in range(4):
        metrics.append(trainer.train(samples, rollout_id))
        weights.append(_weights(trainer))
    return dict(weights=weights, metrics=metrics)


def _reference(path, info) -> dict:
    from colocate.trainer import Trainer

    cfg = _config(
        path,
        **{
            "algorithm.use_kl_loss": True,
            "algorithm.kl_loss_coef": 0.1,
            "algorithm.kl_estimator": "k3",
            "train.global_batch_size": 4,
        },
    )
    trainer = Trainer(cfg, info)
    assert trainer.reference is not None and trainer.critic is None
    # On CPU the offload calls move nothing but still answer, so the loop needs no special case.
    memory = trainer.memory
    moved = [memory.offload(*STATE, *PARAMS).num_bytes, memory.onload(*STATE, *PARAMS).num_bytes]
    return dict(trainer.train(_samples(vocab=101), rollout_id=0), moved=moved)


VARIANTS = {
    "dr_grpo_seq_sum_entropy": {
        "algorithm.advantage_estimator": "dr_grpo",
        "algorithm.loss_agg_mode": "seq_mean_token_sum",
        "algorithm.entropy_coef": 0.01,
    },
    "rloo_gspo": {"algorithm.advantage_estimator": "rloo", "algorithm.policy_loss": "gspo"},
    "reinforce_pp_cispo_tis": {
        "algorithm.advantage_estimator": "reinforce_plus_plus",
        "algorithm.policy_loss": "cispo",
        "algorithm.use_tis": True,
    },
    "reinforce_pp_baseline_mis_dual_clip": {
        "algorithm.advantage_estimator": "reinforce_plus_plus_baseline",
        "algorithm.use_mis": True,
        "algorithm.dual_clip_c": 3.0,
        "algorithm.eps_clip_high": 0.3,
    },
    "grpo_kl_in_reward_two_steps": {
        "algorithm.kl_in_reward": True,
        "algorithm.kl_reward_coef": 0.1,
        "algorithm.kl_estimator": "k1",
        "train.global_batch_size": 4,
    },
}


def _variant_samples() -> list[Sample]:
    """Even samples claim about the policy's own log-probs (near-uniform: -log 101), odd ones -2."""
    samples = _samples(vocab=101)
    for s in samples[::2]:
        s.rollout_logprobs = [-math.log(101)] * s.response_len
    return samples


def _variants(path, info) -> dict:
    from colocate.trainer import Trainer

    return {
        name: Trainer(_config(path, **overrides), info).train(_variant_samples(), rollout_id=0)
        for name, overrides in VARIANTS.items()
    }


def _resume(path, info, directory) -> tuple[dict, dict]:
    """A second trainer restored from the first one's checkpoint, then both train on one batch."""
    from colocate.checkpoint import load_checkpoint, save_checkpoint
    from colocate.trainer import Trainer

    cfg = _config(path, **{"algorithm.advantage_estimator": "gae", "train.lr_schedule": "cosine"})
    first = Trainer(cfg, info)
    first.train(_samples(vocab=101), rollout_id=0)
    saved = save_checkpoint(directory, 0, first.checkpoint_states(), model_dir=path)
    second = Trainer(cfg, info)
    load_checkpoint(saved, second.checkpoint_states())
    batch = _samples(vocab=101, seed=5)
    return first.train(batch, rollout_id=1), second.train(batch, rollout_id=1)


def _compiled(path, info, directory) -> dict:
    """Gradients with eager and with compiled blocks, for Qwen2 and Qwen3 blocks, over
    micro-batches of changing length. Compiled here means dynamo + AOTAutograd without code
    generation (backend aot_eager): it checks the traced graphs and their backward, cheaply; then
    Qwen2 once with inductor. No block is recomputed: CPU attention loops over the sequences
    (a graph break), and a graph break inside a checkpointed block makes it run eager."""
    import functools

    from torch._dynamo.utils import counters

    from colocate.trainer import Trainer

    qwen3, _ = write_hf_model(directory, "qwen3")
    compile_fn = torch.compile
    torch.compile = functools.partial(compile_fn, backend="aot_eager")
    try:
        out = {}
        for family, model in (("qwen2", path), ("qwen3", qwen3)):
            for compiled in (False, True):
                cfg = _config(model, **{"model.compile": compiled, "train.max_tokens_per_gpu": 24})
                trainer = Trainer(cfg, info)
                grads = capture_grads(trainer)
                graphs = counters["stats"]["unique_graphs"]
                trainer.train(_samples(vocab=101), rollout_id=0)
                out[family, compiled] = grads
                out[family, compiled, "graphs"] = counters["stats"]["unique_graphs"] - graphs
    finally:
        torch.compile = compile_fn
    trainer = Trainer(_config(path, **{"model.compile": True, "train.max_tokens_per_gpu": 24}), info)
    grads = capture_grads(trainer)
    trainer.train(_samples(vocab=101), rollout_id=0)  # inductor's C++ code, one family (compiling costs seconds)
    out["qwen2", "inductor"] = grads
    return out


def _one_rank(rank, world_size, path, out_file):
    """Every single-process scenario in one spawned process (starting one costs seconds)."""
    from colocate import dist

    torch.set_num_threads(1)  # tiny models: extra intra-op threads only fight over the cores
    info = dist.get_info()
    torch.save(
        dict(
            modes=_modes(path, _samples(vocab=101), rank, world_size),
            budgets=_budgets(path, info),
            first_steps=_first_steps(path, info),
            nan=_nan_reward(path, info),
            critic=_critic(path, info),
            reference=_reference(path, info),
            variants=_variants(path, info),
            resume=_resume(path, info, out_file.parent / "ckpt"),
            compiled=_compiled(path, info, out_file.parent),
        ),
        out_file,
    )


@pytest.fixture(scope="module")
def one_rank(model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "results.pt"
    run_ranks(_one_rank, 1, model_path, out)
    return torch.load(out)


def _assert_close(a: dict, b: dict, atol: float):
    assert set(a) == set(b)
    for name in a:
        assert (a[name] - b[name]).abs().max() <= atol, name


def _moved(a: dict, b: dict) -> bool:
    return any((a[n] - b[n]).abs().max() > 1e-6 for n in a)


def test_two_ranks_give_the_one_process_gradients_and_weights(tmp_path, model_path, one_rank):
    run_ranks(_two_ranks, 2, model_path, tmp_path / "two.pt")
    two = torch.load(tmp_path / "two.pt")
    start = {n: p.detach() for n, p in from_pretrained(model_path, dtype="float32").named_parameters()}
    for mode in ("token_mean", "seq_mean_token_mean", "uneven", "uneven_gathered"):
        (g1, w1, m1), (g2, w2, m2) = one_rank["modes"][mode], two[mode]
        _assert_close(g1, g2, 1e-5)
        _assert_close(w1, w2, 1e-5)
        assert _moved(start, w1), "the step did not move the weights"
        expected_norm = math.sqrt(sum(float(g.square().sum()) for g in g1.values()))
        assert abs(m1["train/grad_norm"] - expected_norm) < 1e-5 * max(1.0, expected_norm)
        assert abs(m1["train/grad_norm"] - m2["train/grad_norm"]) < 1e-5
        assert abs(m1["train/pg_loss"] - m2["train/pg_loss"]) < 1e-6
    # The modes weigh tokens differently, so their gradients differ.
    assert _moved(one_rank["modes"]["token_mean"][0], one_rank["modes"]["seq_mean_token_mean"][0])


def plain_grpo_loss(logits_fn, samples, mode) -> torch.Tensor:
    """The first-step GRPO/PPO loss written out on a plain model's logits, one sample at a time.

    With no update yet the ratio is 1 and nothing clips, so the loss of token t of sample i is
    -A_i * exp(lp_t - sg(lp_t)), averaged over the batch's masked tokens (token_mean) or per
    sample then over samples (seq_mean_token_mean).
    """
    from colocate.algo import grpo

    adv = grpo(torch.tensor([s.reward for s in samples]), GROUP)
    num_tokens = sum(sum(s.loss_mask) for s in samples)
    loss = 0.0
    for i, s in enumerate(samples):
        logp = torch.log_softmax(logits_fn(torch.tensor(s.tokens)), dim=-1)[len(s.prompt_ids) - 1 : -1]
        lp = logp.gather(1, torch.tensor(s.response_ids)[:, None]).squeeze(1)
        per_token = -adv[i] * torch.exp(lp - lp.detach()) * torch.tensor(s.loss_mask, dtype=torch.float32)
        if mode == "token_mean":
            loss = loss + per_token.sum() / num_tokens
        else:
            loss = loss + per_token.sum() / sum(s.loss_mask) / len(samples)
    return loss


def _plain_grpo_grads(path, samples, mode) -> dict:
    """The gradient of plain_grpo_loss on the plain model."""
    model = from_pretrained(path, dtype="float32")
    plain_grpo_loss(model, samples, mode).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_gradients_match_a_plain_torch_reference(model_path, one_rank):
    for mode in ("token_mean", "seq_mean_token_mean"):
        expected = _plain_grpo_grads(model_path, _samples(vocab=101), mode)
        _assert_close(one_rank["modes"][mode][0], expected, 1e-5)


def test_gradients_do_not_depend_on_the_token_budget_or_recomputation(one_rank):
    big, *others = one_rank["budgets"]
    assert len(others) == 3
    for other in others:
        _assert_close(big, other, 1e-6)


def test_compiled_blocks_give_the_eager_gradients(one_rank):
    for family in ("qwen2", "qwen3"):
        compiled = one_rank["compiled"]
        assert compiled[family, False, "graphs"] == 0 and compiled[family, True, "graphs"] >= 2  # two block kinds
        _assert_close(compiled[family, True], compiled[family, False], 1e-6)
    # Inductor itself on CPU (fused fp32 kernels: not the eager roundings).
    _assert_close(one_rank["compiled"]["qwen2", "inductor"], one_rank["compiled"]["qwen2", False], 1e-5)


def test_first_step_log_probs_match_the_behaviour_policy(one_rank):
    one, two = one_rank["first_steps"]["one_step"], one_rank["first_steps"]["two_steps"]
    assert one["train/ppo_kl"] == 0.0 and one["train/pg_clipfrac"] == 0.0
    assert one["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert "perf/old_logprob_time" not in one  # one step: no separate old-log-prob pass
    assert "perf/old_logprob_time" in two
    assert two["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert two["train/skipped_steps"] == 0.0


def test_non_finite_loss_skips_the_step(one_rank):
    r = one_rank["nan"]
    assert r["skipped"]["train/skipped_steps"] == 1.0
    _assert_close(r["before"], r["after_skip"], 0.0)
    assert r["clean"]["train/skipped_steps"] == 0.0
    assert _moved(r["after_skip"], r["after_clean"])


def test_critic_trains_first_and_its_value_loss_decreases(one_rank):
    weights, metrics = one_rank["critic"]["weights"], one_rank["critic"]["metrics"]
    losses = [m["critic/value_loss"] for m in metrics]
    assert losses[0] > 0
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    for step in (0, 1):  # critic-only warm-up: the policy does not move
        assert "train/pg_loss" not in metrics[step]
        _assert_close(weights[0], weights[step + 1], 0.0)
    assert "train/pg_loss" in metrics[2] and _moved(weights[2], weights[3])


def test_reference_starts_equal_to_the_policy_and_offload_is_a_no_op_on_cpu(one_rank):
    m = one_rank["reference"]
    assert m["moved"] == [0, 0]
    assert "perf/ref_logprob_time" in m
    # Step 1 runs on the reference's own weights (KL exactly 0); step 2 after one update (KL > 0).
    assert 0.0 < m["train/kl_loss"] < 1e-3


def test_resumed_trainer_continues_exactly(one_rank):
    first, second = one_rank["resume"]
    for key in ("train/pg_loss", "train/grad_norm", "train/lr", "critic/value_loss", "critic/grad_norm"):
        assert first[key] == second[key], key
    assert first["train/lr"] < 1e-3  # the cosine schedule has moved on, in both


def test_every_estimator_and_loss_variant_trains(one_rank):
    runs = one_rank["variants"]
    assert set(runs) == set(VARIANTS)
    for name, m in runs.items():
        assert all(math.isfinite(v) for v in m.values()), name
        assert m["train/skipped_steps"] == 0.0 and m["train/grad_norm"] > 0, name
    assert runs["reinforce_pp_cispo_tis"]["train/tis_clipfrac"] == 0.0  # every ratio is about 1 or < 1
    # MIS drops exactly the odd samples (ratio exp(-4.6 + 2) < mis_low) and keeps the even ones.
    samples = _variant_samples()
    odd = sum(sum(s.loss_mask) for s in samples[1::2]) / sum(sum(s.loss_mask) for s in samples)
    assert abs(runs["reinforce_pp_baseline_mis_dual_clip"]["train/mis_dropfrac"] - odd) < 1e-6
    assert "perf/old_logprob_time" in runs["grpo_kl_in_reward_two_steps"]


def test_advantages_match_the_algo_estimators():
    from colocate import algo
    from colocate.trainer.batch import RolloutBatch
    from colocate.trainer.global_advantages import compute_advantages

    cfg = _config("unused").algorithm
    batch = RolloutBatch.from_samples(_samples(vocab=101, num_groups=3), torch.device("cpu"))
    r, idx, mask = batch.rewards, batch.seq_index, batch.mask
    kl = torch.linspace(-0.5, 0.5, mask.numel())
    batch["old_logprobs"], batch["ref_logprobs"] = kl - 1.0, torch.full_like(kl, -1.0)
    batch["values"] = torch.linspace(0.0, 1.0, mask.numel())

    def run(**fields):
        for k, v in fields.items():
            setattr(cfg, k, v)
        compute_advantages(batch, cfg, GROUP)
        return batch["advantages"]

    assert torch.allclose(run(advantage_estimator="grpo"), algo.broadcast_to_tokens(algo.grpo(r, GROUP), idx, mask))
    assert torch.allclose(run(advantage_estimator="rloo"), algo.broadcast_to_tokens(algo.rloo(r, GROUP), idx, mask))
    assert torch.allclose(
        run(advantage_estimator="reinforce_plus_plus", gamma=0.9),
        algo.reinforce_plus_plus(r, idx, mask, None, 0.0, gamma=0.9),
        atol=1e-6,
    )
    assert torch.allclose(
        run(advantage_estimator="reinforce_plus_plus_baseline"),
        algo.reinforce_plus_plus_baseline(r, GROUP, idx, mask, None, 0.0),
        atol=1e-6,
    )
    adv, returns = algo.gae(algo.token_rewards(r, idx, mask), batch["values"], idx, mask, 0.9, 0.8)
    assert torch.allclose(run(advantage_estimator="gae", lam=0.8), algo.whiten(adv, mask), atol=1e-6)
    assert torch.allclose(batch["returns"], returns)
    # KL in the reward: the sequence's summed per-token KL (k1 = old - ref) comes off its reward.
    penalised = r - 0.5 * torch.zeros_like(r).index_add(0, idx, kl * mask)
    expected = algo.broadcast_to_tokens(algo.grpo(penalised, GROUP), idx, mask)
    got = run(advantage_estimator="grpo", kl_in_reward=True, kl_reward_coef=0.5, kl_estimator="k1")
    assert torch.allclose(got, expected, atol=1e-6)


def test_group_advantages_follow_normalize_advantage_std_and_dr_grpo():
    """grpo divides each sequence's centred reward r_i - mean_g(r) by the group's unbiased std
    (+ 1e-6) unless normalize_advantage_std is off; dr_grpo never divides. Every token of a
    sequence carries its advantage."""
    from colocate.trainer.batch import RolloutBatch
    from colocate.trainer.global_advantages import compute_advantages

    cfg = _config("unused").algorithm
    batch = RolloutBatch.from_samples(_samples(vocab=101, num_groups=3), torch.device("cpu"))
    grouped = batch.rewards.view(-1, GROUP)
    centred = grouped - grouped.mean(1, keepdim=True)
    normalised = centred / (grouped.std(1, keepdim=True) + 1e-6)
    assert (normalised - centred).abs().max() > 0.1  # the std is far from 1: the two differ

    def run(estimator: str, normalize_std: bool) -> torch.Tensor:
        cfg.advantage_estimator, cfg.normalize_advantage_std = estimator, normalize_std
        compute_advantages(batch, cfg, GROUP)
        return batch["advantages"]

    def tokens(seq_adv: torch.Tensor) -> torch.Tensor:
        return seq_adv.reshape(-1)[batch.seq_index] * batch.mask

    assert torch.allclose(run("grpo", True), tokens(normalised), atol=1e-6)
    assert torch.allclose(run("grpo", False), tokens(centred), atol=1e-6)
    assert torch.allclose(run("dr_grpo", True), tokens(centred), atol=1e-6)
