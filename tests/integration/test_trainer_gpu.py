"""The trainer on one CUDA device: bf16 FSDP2 steps through the Triton log-prob kernel, the
reference model's offload between uses, and the offload/onload round trip of both methods."""

import math

import pytest
import torch

from colocate.config import Config
from colocate.rollout.sample import Sample
from colocate.trainer.memory import ACTOR_OPTIM, ACTOR_PARAMS, PARAMS, STATE
from tests.helpers import bf16_copy, capture_grads, exact_fp32_matmuls, hf_logprobs, write_hf_model
from tests.tolerances import assert_grads_within_noise, assert_mean_within_noise, error_stats

pytestmark = pytest.mark.gpu

GROUP = 4
# Flash attention wants head dims that are multiples of 8.
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
MEDIUM = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4
)


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


def _behaviour_logprobs(hf, samples, temperature) -> float:
    """Set every sample's rollout log-probs to transformers' fp32 ones of its tokens (an exact
    behaviour policy); return transformers' bf16 mean error against them on the same tokens."""
    sequences = [(s.prompt_ids, s.response_ids) for s in samples]
    hf32 = hf.cuda()
    reference = hf_logprobs(hf32, sequences, temperature)
    for s, logprobs in zip(samples, reference.split([len(s.response_ids) for s in samples])):
        s.rollout_logprobs = logprobs.tolist()
    return error_stats(hf_logprobs(bf16_copy(hf32), sequences, temperature), reference).mean


def _weights(trainer) -> dict:
    return {n: p.full_tensor().float().clone() for n, p in trainer.actor_module.named_parameters()}


def test_bf16_kernel_path_step_matches_the_fp32_behaviour_policy(tmp_path, info):
    from colocate.trainer import Trainer

    path, hf = write_hf_model(tmp_path, "qwen2", bf16_weights=True, **SMALL)
    samples = _samples(SMALL["vocab_size"])
    baseline = _behaviour_logprobs(hf, samples, temperature=0.8)
    trainer = Trainer(_config(path, **{"rollout.temperature": 0.8, "model.gradient_checkpointing": True}), info)
    assert trainer.compute_dtype == torch.bfloat16
    before = _weights(trainer)
    m = trainer.train(samples, rollout_id=0)
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0
    # bf16 compute against transformers' fp32 forward: not equal, and no further than
    # transformers' own bf16 forward is on the same tokens (a mean: the metric is one).
    diff = m["train/train_rollout_logprob_abs_diff"]
    print(f"\n|trainer bf16 - fp32| mean {diff:.2e}; |transformers bf16 - fp32| mean {baseline:.2e}")
    assert diff > 0.0
    assert_mean_within_noise(diff, baseline, "trainer bf16 log-probs")
    assert math.isfinite(m["train/grad_norm"]) and m["train/grad_norm"] > 0 and m["train/skipped_steps"] == 0
    after = _weights(trainer)
    assert any((after[n] - before[n]).abs().max() > 0 for n in before)
    m2 = trainer.train(samples, rollout_id=1)
    assert m2["train/ppo_kl"] == 0.0 and m2["train/train_rollout_logprob_abs_diff"] > 0.0


def test_reference_is_offloaded_between_uses(tmp_path, info):
    from colocate.trainer import Trainer

    path, _ = write_hf_model(tmp_path, "qwen2", **SMALL)
    cfg = _config(path, **{"algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.01, "train.global_batch_size": 8})
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
        stats = memory.onload(*STATE, *PARAMS, overlap=overlap)
        away = memory.pending_bytes()
        assert (away > 0) == overlap == memory.is_offloaded(ACTOR_OPTIM)
        streamed = memory.param_arrivals[ACTOR_PARAMS].pending  # each block's wait in the next forward
        assert len(streamed) == (len(trainer.actor_module.model.layers) if overlap else 0)
        storages = {
            p.to_local().untyped_storage().data_ptr(): p.to_local().untyped_storage().nbytes()
            for p in trainer.actor_module.parameters()
        }
        assert stats.num_bytes == sum(storages.values()) if overlap else stats.num_bytes > sum(storages.values())
        parts, onload_part = [], memory.offloader.onload_part
        memory.offloader.onload_part = lambda *args: parts.append(onload_part(*args)) or parts[-1]
        trainer.train(samples, rollout_id=1)
        assert not memory.is_offloaded(ACTOR_OPTIM) and memory.pending_bytes() == 0 and not streamed
        assert memory.offloader.groups[ACTOR_OPTIM].arrived is None
        if overlap:  # all of it came home in the backward, one parameter's state at a time
            assert sum(parts) == away and sum(p > 0 for p in parts) == len(list(trainer.actor_module.parameters()))
        weights.append({n: p.full_tensor().cpu() for n, p in trainer.actor_module.named_parameters()})
        del trainer
        torch.cuda.empty_cache()
    for name, expected in weights[0].items():
        torch.testing.assert_close(weights[1][name], expected, rtol=0, atol=1e-5, msg=name)


def test_partial_onload_brings_back_just_the_chosen_tensors(monkeypatch):
    """The pinned offloader's per-tensor onload: the chosen tensors' storages (a view counts as its
    base's) come back with their bytes, the rest stays away until the group's onload. Pieces of
    8 KiB put the storages in two pinned pieces."""
    from colocate.trainer import offload
    from colocate.trainer.offload import StateOffloader

    monkeypatch.setattr(offload, "_PIECE", 4096)

    base = torch.randn(64, 32, device="cuda")
    tensors = [base, base[8:16], torch.randn(1000, device="cuda"), torch.arange(7, device="cuda")]
    saved = [t.clone() for t in tensors]
    offloader = StateOffloader("pinned", torch.device("cuda"))
    offloader.register("g", lambda: tensors)
    total = offloader.offload(["g"]).num_bytes
    assert total == (64 * 32 + 1000) * 4 + 7 * 8 and offloader.away_bytes("g") == total
    assert offloader.groups["g"].pieces.sizes == [64 * 32 * 4, 4096 + 512]
    assert offloader.onload_part("g", [tensors[1]]) == 64 * 32 * 4
    assert offloader.onload_part("g", [tensors[0]]) == 0  # already queued
    offloader.wait(["g"])
    assert torch.equal(tensors[0], saved[0]) and torch.equal(tensors[1], saved[1])
    assert tensors[2].untyped_storage().nbytes() == 0 and offloader.is_offloaded("g")
    assert offloader.onload(["g"], wait=True).num_bytes == 1000 * 4 + 7 * 8
    assert not offloader.is_offloaded("g") and offloader.away_bytes("g") == 0
    assert all(torch.equal(t, s) for t, s in zip(tensors, saved))


def test_constant_tensors_are_copied_out_once():
    """A group's constant tensors (the frozen base under LoRA) go to the host at the first offload
    only; later offloads free their storages without copying, and each onload brings back their
    bytes, beside the changing tensors' new ones. A new layout copies everything again."""
    from colocate.trainer.offload import StateOffloader

    frozen, trained = torch.randn(256, 64, device="cuda"), torch.randn(1000, device="cuda")
    frozen.requires_grad_(False)
    trained.requires_grad_(True)
    tensors = [frozen, trained]
    expected_frozen, expected_trained = frozen.clone(), trained.detach().clone()
    offloader = StateOffloader("pinned", torch.device("cuda"))
    offloader.register("g", lambda: tensors, constant=lambda t: not t.requires_grad)
    assert offloader.offload(["g"]).num_bytes == (256 * 64 + 1000) * 4
    for step in range(3):
        offloader.onload(["g"])
        assert torch.equal(frozen, expected_frozen) and torch.equal(trained, expected_trained), step
        with torch.no_grad():
            trained.fill_(step)
        expected_trained = trained.detach().clone()
        assert offloader.offload(["g"]).num_bytes == 1000 * 4  # the frozen bytes stayed on the host
        assert frozen.untyped_storage().nbytes() == 0
    offloader.onload(["g"])
    assert torch.equal(frozen, expected_frozen) and torch.equal(trained, expected_trained)
    tensors.append(torch.zeros(10, device="cuda"))  # a new layout: a new buffer, every byte copied
    assert offloader.offload(["g"]).num_bytes == (256 * 64 + 1000 + 10) * 4


@pytest.mark.parametrize("parts", [False, True], ids=["whole", "by_parts"])
def test_storages_come_back_in_one_device_allocation_and_leave_in_one_release(parts):
    """40 storages of 3-8 MiB come home, whole or part by part, in one cudaMalloc of the caching
    allocator, with their bytes; once offloaded again, empty_cache hands the memory back in one
    cudaFree and none of it stays reserved."""
    from colocate.trainer.offload import StateOffloader

    tensors = [torch.randn((3 << 18) + (i << 15), device="cuda") for i in range(40)]
    saved = [t.cpu() for t in tensors]  # on the host: no device block of theirs, then or later
    offloader = StateOffloader("pinned", torch.device("cuda"))
    offloader.register("g", lambda: tensors)
    offloader.offload(["g"])
    torch.cuda.empty_cache()
    reserved, stats = torch.cuda.memory_reserved(), torch.cuda.memory_stats()
    if parts:
        _, num_bytes = offloader.onload_parts("g", [tensors[:10], tensors[10:25]])
        offloader.wait(["g"])
    else:
        num_bytes = offloader.onload(["g"]).num_bytes
    after = torch.cuda.memory_stats()
    assert num_bytes == sum(t.nbytes for t in tensors)
    assert after["num_device_alloc"] - stats["num_device_alloc"] == 1
    assert all(torch.equal(t.cpu(), s) for t, s in zip(tensors, saved))
    offloader.offload(["g"])
    torch.cuda.empty_cache()
    assert torch.cuda.memory_stats()["num_device_free"] - after["num_device_free"] == 1
    assert torch.cuda.memory_reserved() == reserved


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_compiled_blocks_train_like_eager_ones(tmp_path, info, family):
    """model.compile (inductor, dynamic shapes) with half the blocks recomputed and the rest
    recomputing their element-wise ops: gradients and log-probs as eager bf16 blocks give, to
    within bf16 noise (inductor fuses the element-wise work, so the roundings differ). The noise
    is measured on the same weights and tokens: eager bf16 against eager fp32, per parameter."""
    from torch._dynamo.utils import counters

    from colocate.trainer import Trainer
    from colocate.trainer.parallelize import ActivationCheckpointing

    path, hf = write_hf_model(tmp_path, family, bf16_weights=True, **SMALL)
    samples = _samples(SMALL["vocab_size"])
    _behaviour_logprobs(hf, samples, temperature=Config().rollout.temperature)
    grads, metrics = {}, {}
    for run, overrides in (("fp32", {"model.dtype": "float32"}), ("eager", {}), ("compiled", {"model.compile": True})):
        # No clipping: the gradients themselves are compared, not a rescaling by each run's norm.
        trainer = Trainer(
            _config(path, **{"train.grad_clip": 1e9, **overrides}), info, checkpointing=ActivationCheckpointing(0.5, "ops")
        )
        assert trainer.compute_dtype == (torch.float32 if run == "fp32" else torch.bfloat16)
        grads[run] = capture_grads(trainer)  # fp32: the gradients of the fp32 master weights
        graphs = counters["stats"]["unique_graphs"]
        with exact_fp32_matmuls():
            metrics[run] = trainer.train(samples, rollout_id=0)
        assert (counters["stats"]["unique_graphs"] > graphs) == (run == "compiled")
        del trainer
        torch.cuda.empty_cache()
    # Output: the log-probs of the step's first pass, as a mean distance to transformers' fp32.
    diff = {run: m["train/train_rollout_logprob_abs_diff"] for run, m in metrics.items()}
    print(f"\n|log-probs - transformers fp32| mean: {diff}")
    assert diff["fp32"] <= 0.1 * diff["eager"]  # the noise reference really computes in fp32
    assert_mean_within_noise(diff["compiled"], diff["eager"], "compiled log-probs")
    ratios = assert_grads_within_noise(grads["compiled"], grads["eager"], grads["fp32"], f"compiled {family}")
    worst = max(ratios, key=ratios.get)
    print(f"gradients: worst {worst} at {ratios[worst]:.2f} of its bound")
