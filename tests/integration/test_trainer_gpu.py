"""The trainer on one CUDA device: bf16 FSDP2 steps through the Triton log-prob kernel, the
reference model's offload between uses, and the offload/onload round trip of both methods."""

import math

import pytest
import torch

from colocate.config import Config
from colocate.models import from_pretrained
from colocate.rollout.sample import Sample
from colocate.trainer.memory import ACTOR_OPTIM, PARAMS, STATE
from tests.helpers import capture_grads, write_hf_model

pytestmark = pytest.mark.gpu

GROUP = 4
# Flash attention wants head dims that are multiples of 8.
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
MEDIUM = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
              num_key_value_heads=2, num_hidden_layers=4)


@pytest.fixture(scope="module")
def info():
    from colocate import dist

    yield dist.init()
    dist.destroy()


def _config(path, **overrides) -> Config:
    cfg = Config()
    cfg.model.path = str(path)
    cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt = 4, GROUP
    cfg.train.lr, cfg.train.max_tokens_per_gpu, cfg.train.num_rollout = 1e-4, 256, 4
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _samples(vocab: int, num_groups: int = 4, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(num_groups):
        prompt = torch.randint(2, vocab, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g).tolist()
        for j in range(GROUP):
            n = int(torch.randint(4, 64, (1,), generator=g))
            response = torch.randint(2, vocab, (n,), generator=g).tolist()
            out.append(Sample(prompt, response, [0.0] * n, [1] * n, group, j, reward=float(torch.rand(1, generator=g))))
    return out


def _behaviour_logprobs(path, samples, temperature):
    model = from_pretrained(path, dtype="float32", device="cuda")
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor(s.tokens, device="cuda")) / temperature  # (L, V)
            logp = torch.log_softmax(logits, dim=-1)[len(s.prompt_ids) - 1:-1]
            ids = torch.tensor(s.response_ids, device="cuda")[:, None]
            s.rollout_logprobs = logp.gather(1, ids).squeeze(1).tolist()


def _weights(trainer) -> dict:
    return {n: p.full_tensor().float().clone() for n, p in trainer.actor_module.named_parameters()}


def test_bf16_kernel_path_step_matches_the_fp32_behaviour_policy(tmp_path, info):
    from colocate.trainer import Trainer

    path, _ = write_hf_model(tmp_path, "qwen2", **SMALL)
    samples = _samples(SMALL["vocab_size"])
    _behaviour_logprobs(path, samples, temperature=0.8)
    trainer = Trainer(_config(path, **{"rollout.temperature": 0.8, "model.gradient_checkpointing": True}), info)
    assert trainer.compute_dtype == torch.bfloat16
    before = _weights(trainer)
    m = trainer.train(samples, rollout_id=0)
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0
    # bf16 compute against the fp32 engine-side definition: close, not equal.
    assert 0.0 < m["train/train_rollout_logprob_abs_diff"] < 2e-2
    assert math.isfinite(m["train/grad_norm"]) and m["train/grad_norm"] > 0 and m["train/skipped_steps"] == 0
    after = _weights(trainer)
    assert any((after[n] - before[n]).abs().max() > 0 for n in before)
    m2 = trainer.train(samples, rollout_id=1)
    assert m2["train/ppo_kl"] == 0.0 and m2["train/train_rollout_logprob_abs_diff"] > 0.0


def test_reference_is_offloaded_between_uses(tmp_path, info):
    from colocate.trainer import Trainer

    path, _ = write_hf_model(tmp_path, "qwen2", **SMALL)
    cfg = _config(path, **{"algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.01,
                           "train.global_batch_size": 8})
    trainer = Trainer(cfg, info)
    ref_bytes = sum(p.to_local().nbytes for p in trainer.reference.model.parameters())
    assert trainer.reference.offloaded
    m = trainer.train(_samples(SMALL["vocab_size"]), rollout_id=0)
    assert trainer.reference.offloaded
    assert trainer.reference.last_onload.num_bytes >= ref_bytes
    assert trainer.reference.last_offload.num_bytes >= ref_bytes
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in trainer.reference.model.parameters())
    assert math.isfinite(m["train/kl_loss"]) and m["train/kl_loss"] >= 0.0


def _state_tensors(trainer) -> dict:
    """Every parameter shard and optimizer-state tensor of the actor, by a stable key."""
    out = {}
    names = {id(p): n for n, p in trainer.actor_module.named_parameters()}
    for p in trainer.actor_module.parameters():
        out[names[id(p)]] = p.to_local()
        for key, value in trainer.actor.opt.optimizer.state[p].items():
            if torch.is_tensor(value):
                out[f"{names[id(p)]}/{key}"] = value.to_local() if hasattr(value, "to_local") else value
    return out


@pytest.mark.parametrize("method", ["pinned", "tms"])
def test_offload_round_trip_restores_values_and_frees_memory(tmp_path, info, method):
    from colocate.trainer import Trainer

    if method == "tms":
        pytest.importorskip("torch_memory_saver")
    path, _ = write_hf_model(tmp_path, "qwen2", **MEDIUM)
    trainer = Trainer(_config(path, **{"offload.method": method}), info)
    samples = _samples(MEDIUM["vocab_size"])
    trainer.train(samples, rollout_id=0)
    tensors = _state_tensors(trainer)
    saved = {k: t.detach().cpu().clone() for k, t in tensors.items()}
    state_bytes = sum(t.untyped_storage().nbytes() for t in tensors.values())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated, free = torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]

    stats = trainer.memory.offload(*STATE, *PARAMS)
    torch.cuda.synchronize()
    assert stats.num_bytes >= 0.95 * state_bytes and stats.gb_per_s > 0
    if method == "pinned":
        assert allocated - torch.cuda.memory_allocated() >= 0.95 * state_bytes
    else:  # the memory saver unmaps pages behind the allocator: the device sees them free
        assert torch.cuda.mem_get_info()[0] - free >= 0.95 * state_bytes

    stats = trainer.memory.onload(*STATE, *PARAMS)
    assert stats.num_bytes >= 0.95 * state_bytes
    after = _state_tensors(trainer)
    assert set(after) == set(tensors)
    for key, t in after.items():
        # Same storage objects as before (FSDP and the optimizer still hold them), same bytes.
        assert t.untyped_storage().data_ptr() == tensors[key].untyped_storage().data_ptr() != 0, key
        assert torch.equal(t.cpu(), saved[key]), key
    m = trainer.train(samples, rollout_id=1)  # the module and the optimizer still work
    assert math.isfinite(m["train/grad_norm"]) and m["train/skipped_steps"] == 0


def test_overlapped_onload_updates_like_a_waited_one(tmp_path, info, deterministic):
    """The loop's onload leaves the optimizer state on the host through the forward passes; each
    parameter's state is queued home in the last backward once FSDP has reduced its gradient, and
    the optimizer waits for it right before its update: that update equals the one after a fully
    waited onload. (A step that read the state before it arrived would move the weights by about
    the learning rate, 1e-4.) Ordered kernels: Adam's first update is about lr * sign(grad), which
    rounding noise would flip where a gradient is near 0."""
    from colocate.trainer import Trainer

    path, _ = write_hf_model(tmp_path, "qwen2", **MEDIUM)
    samples = _samples(MEDIUM["vocab_size"])
    weights = []
    for overlap in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(_config(path), info)
        trainer.train(samples, rollout_id=0)
        memory = trainer.memory
        memory.offload(*STATE, *PARAMS)
        stats = memory.onload(*STATE, *PARAMS, stream_state=overlap)
        away = memory.pending_bytes()
        assert (away > 0) == overlap == memory.is_offloaded(ACTOR_OPTIM)
        storages = {p.to_local().untyped_storage().data_ptr(): p.to_local().untyped_storage().nbytes()
                    for p in trainer.actor_module.parameters()}
        assert stats.num_bytes == sum(storages.values()) if overlap else stats.num_bytes > sum(storages.values())
        parts, onload_part = [], memory.offloader.onload_part
        memory.offloader.onload_part = lambda *args: parts.append(onload_part(*args)) or parts[-1]
        trainer.train(samples, rollout_id=1)
        assert not memory.is_offloaded(ACTOR_OPTIM) and memory.pending_bytes() == 0
        assert memory.offloader.groups[ACTOR_OPTIM].arrived is None
        if overlap:  # all of it came home in the backward, one parameter's state at a time
            assert sum(parts) == away and sum(p > 0 for p in parts) == len(list(trainer.actor_module.parameters()))
        weights.append({n: p.full_tensor().cpu() for n, p in trainer.actor_module.named_parameters()})
        del trainer
        torch.cuda.empty_cache()
    for name, expected in weights[0].items():
        torch.testing.assert_close(weights[1][name], expected, rtol=0, atol=1e-5, msg=name)


def test_partial_onload_brings_back_just_the_chosen_tensors():
    """The pinned offloader's per-tensor onload: the chosen tensors' storages (a view counts as its
    base's) come back with their bytes, the rest stays away until the group's onload."""
    from colocate.trainer.offload import StateOffloader

    base = torch.randn(64, 32, device="cuda")
    tensors = [base, base[8:16], torch.randn(1000, device="cuda"), torch.arange(7, device="cuda")]
    saved = [t.clone() for t in tensors]
    offloader = StateOffloader("pinned", torch.device("cuda"))
    offloader.register("g", lambda: tensors)
    total = offloader.offload(["g"]).num_bytes
    assert total == (64 * 32 + 1000) * 4 + 7 * 8 and offloader.away_bytes("g") == total
    assert offloader.onload_part("g", [tensors[1]]) == 64 * 32 * 4
    assert offloader.onload_part("g", [tensors[0]]) == 0  # already queued
    offloader.wait(["g"])
    assert torch.equal(tensors[0], saved[0]) and torch.equal(tensors[1], saved[1])
    assert tensors[2].untyped_storage().nbytes() == 0 and offloader.is_offloaded("g")
    assert offloader.onload(["g"], wait=True).num_bytes == 1000 * 4 + 7 * 8
    assert not offloader.is_offloaded("g") and offloader.away_bytes("g") == 0
    assert all(torch.equal(t, s) for t, s in zip(tensors, saved))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_compiled_blocks_train_like_eager_ones(tmp_path, info, family):
    """model.compile (inductor, dynamic shapes) with half the blocks recomputed and the rest
    recomputing their element-wise ops: same metrics and gradients as eager blocks, to bf16
    rounding (inductor fuses the element-wise work, so the roundings differ)."""
    from torch._dynamo.utils import counters

    from colocate.trainer import Trainer
    from colocate.trainer.parallelize import ActivationCheckpointing

    path, _ = write_hf_model(tmp_path, family, **SMALL)
    samples = _samples(SMALL["vocab_size"])
    grads, metrics = [], []
    for compiled in (False, True):
        trainer = Trainer(_config(path, **{"model.compile": compiled}), info,
                          checkpointing=ActivationCheckpointing(0.5, "ops"))
        grads.append(capture_grads(trainer))  # fp32: the gradients of the fp32 master weights
        graphs = counters["stats"]["unique_graphs"]
        metrics.append(trainer.train(samples, rollout_id=0))
        assert (counters["stats"]["unique_graphs"] > graphs) == compiled
    eager, compiled = metrics
    assert abs(compiled["train/grad_norm"] - eager["train/grad_norm"]) <= 2e-2 * eager["train/grad_norm"]
    assert abs(compiled["train/entropy_loss"] - eager["train/entropy_loss"]) <= 1e-2 * abs(eager["train/entropy_loss"])
    flat = [torch.cat([g[n].flatten() for n in sorted(g)]) for g in grads]
    assert torch.nn.functional.cosine_similarity(flat[0], flat[1], dim=0) > 0.99
    # Per parameter, relative to its own gradient, with a floor for gradients that are zero in
    # exact arithmetic (the key bias: softmax ignores a shift shared by all keys).
    for name, g in grads[0].items():
        assert (grads[1][name] - g).norm() <= 0.1 * g.norm() + 1e-2 * flat[0].norm(), name
