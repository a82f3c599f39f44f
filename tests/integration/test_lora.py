"""LoRA through the FSDP2 trainer on CPU (gloo): the first steps, gradients against a plain-torch
reference, recomputation and compilation, the reference policy, the merged weight push (against
peft's merge), checkpoints and both exports, the LoRA critic, 2 ranks against 1; and bf16 on one
GPU. The whole loop with LoRA: test_lora_loop.py.

Every single-process scenario runs in one spawned process (`one_rank`), as in test_trainer_fsdp."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from colocate.lora.identity import is_adapter
from colocate.models import from_pretrained
from tests.distributed import run_ranks
from tests.helpers import capture_grads, write_hf_model
from tests.integration.test_trainer_fsdp import _config, _samples, plain_grpo_loss
from tests.integration.test_weight_sync import RecordingEngine

RANK, ALPHA = 4, 8.0
LORA = {"model.lora_rank": RANK, "model.lora_alpha": ALPHA}
GAE = {"algorithm.advantage_estimator": "gae", "train.critic_lr": 1e-3}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path, _ = write_hf_model(tmp_path_factory.mktemp("model"), "qwen2")  # tied embeddings, q/k/v biases
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return path


def _lora(path, **overrides):
    return _config(path, **{**LORA, **overrides})


def _adapters(trainer) -> dict:
    return {n: p.detach().full_tensor().clone() for n, p in trainer.actor_module.named_parameters() if is_adapter(n)}


@torch.no_grad()
def _logits(trainer, ids) -> torch.Tensor:
    from colocate.trainer.parallelize import reshard_all

    out = trainer.actor_module(ids)
    reshard_all(trainer.actor_module)
    return out


def _two_steps(path, info, samples, **overrides) -> dict:
    """Adapters after a first step, the gradients of a second (B is no longer zero: A has one too),
    the adapters after it, and the weights an fp32 engine receives."""
    from colocate.colocation.weight_sync import sync_weights
    from colocate.trainer import Trainer

    trainer = Trainer(_lora(path, **overrides), info)
    trainer.train(samples, rollout_id=0)
    before = _adapters(trainer)
    grads = capture_grads(trainer)
    metrics = trainer.train(samples, rollout_id=1)
    engine = RecordingEngine()
    sync_weights(trainer.actor_module, engine, version=1, dtype=torch.float32, bucket_bytes=4096)
    pushed = {n: t for b in engine.buckets for n, t in b}
    return dict(before=before, grads=dict(grads), after=_adapters(trainer), metrics=metrics, pushed=pushed)


def _start_and_push(path, info) -> dict:
    """Logits at step 0 (LoRA vs full training), then pushes into native engines: complete, then
    partial after another step."""
    from colocate.colocation.weight_sync import sync_weights
    from colocate.rollout.native import NativeEngine
    from colocate.trainer import Trainer
    from colocate.trainer.memory import ACTOR_OPTIM, ACTOR_PARAMS

    samples = _samples(vocab=101)
    ids = torch.tensor(samples[0].tokens)
    trainer, full = Trainer(_lora(path), info), Trainer(_config(path), info)
    out = dict(
        init=(_logits(trainer, ids), _logits(full, ids)),
        num_trained=len(trainer.actor.opt.params),
        optim_state=[sorted(s) for s in trainer.actor.opt.optimizer.state.values()],
    )
    trainer.train(samples, rollout_id=0)
    groups = trainer.memory.offloader.groups  # what an offload would move (offload.keep_adapters)
    frozen = {id(p) for p in trainer.actor_module.parameters() if not p.requires_grad}
    out["offload_sources"] = ({id(t) for t in groups[ACTOR_PARAMS].source()} == frozen, len(list(groups[ACTOR_OPTIM].source())))
    engines = {dtype: NativeEngine(str(path), dtype=dtype, max_kv_tokens=256) for dtype in (torch.float32, torch.bfloat16)}
    for dtype, engine in engines.items():
        out[dtype, "stats"] = sync_weights(trainer.actor_module, engine, version=1, dtype=dtype)
        out[dtype, "engine"] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    out["adapters"] = _adapters(trainer)
    trainer.train(samples, rollout_id=1)
    engine = engines[torch.float32]
    out["partial_stats"] = sync_weights(trainer.actor_module, engine, version=2, dtype=torch.float32, since_last=True)
    out["partial_engine"] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    out["partial_adapters"] = _adapters(trainer)
    return out


def _reference(path, info) -> dict:
    from colocate.trainer import Trainer
    from colocate.trainer.memory import REFERENCE

    cfg = _lora(
        path,
        **{
            "algorithm.use_kl_loss": True,
            "algorithm.kl_loss_coef": 0.1,
            "algorithm.kl_estimator": "k3",
            "train.global_batch_size": 4,
        },
    )
    trainer = Trainer(cfg, info)
    shared = trainer.reference.model is trainer.actor_module and REFERENCE not in trainer.memory.offloader.groups
    return dict(shared=shared, metrics=[trainer.train(_samples(vocab=101), rollout_id=i) for i in range(2)])


def _recompute_and_compile(path, info, directory) -> dict:
    """Second-step gradients eager vs recomputed blocks vs compiled blocks (aot_eager, as in
    test_trainer_fsdp), and with dropout, recomputed vs not under one seed."""
    samples = _samples(vocab=101)
    out = {"eager": _two_steps(path, info, samples, **{"train.max_tokens_per_gpu": 4096})["grads"]}
    out["full"] = _two_steps(path, info, samples, **{"train.max_tokens_per_gpu": 16, "model.gradient_checkpointing": True})[
        "grads"
    ]
    out["mlp"] = _two_steps(
        path, info, samples, **{"train.max_tokens_per_gpu": 32, "model.recompute_fraction": 0.5, "model.recompute_rest": "mlp"}
    )["grads"]
    for recompute in (False, True):
        torch.manual_seed(7)
        out["dropout", recompute] = _two_steps(
            path, info, samples, **{"model.lora_dropout": 0.3, "model.gradient_checkpointing": recompute}
        )["grads"]
    qwen3, _ = write_hf_model(directory, "qwen3")
    compile_fn = torch.compile
    torch.compile = functools.partial(compile_fn, backend="aot_eager")
    try:
        for compiled in (False, True):
            out["qwen3", compiled] = _two_steps(
                qwen3, info, samples, **{"model.compile": compiled, "train.max_tokens_per_gpu": 24}
            )["grads"]
    finally:
        torch.compile = compile_fn
    return out


def _resume(path, info, directory) -> dict:
    """A second LoRA trainer restored from the first one's checkpoint; then checkpoints of another
    base and of the other kind are refused."""
    from colocate.checkpoint import load_checkpoint, save_checkpoint
    from colocate.trainer import Trainer

    cfg = _lora(path, **{"train.lr_schedule": "cosine"})
    first = Trainer(cfg, info)
    first.train(_samples(vocab=101), rollout_id=0)
    saved = save_checkpoint(directory / "lora", 0, first.checkpoint_states(), model_dir=path)
    ids = torch.tensor(_samples(vocab=101, seed=9)[0].tokens)
    out = dict(saved=saved, ids=ids, logits_at_save=_logits(first, ids), errors={})
    second = Trainer(cfg, info)
    load_checkpoint(saved, second.checkpoint_states())
    batch = _samples(vocab=101, seed=5)
    out["metrics"] = (first.train(batch, rollout_id=1), second.train(batch, rollout_id=1))
    out["adapters"] = (_adapters(first), _adapters(second))
    other, _ = write_hf_model(directory, "qwen2", hidden_size=48)
    full_saved = save_checkpoint(directory / "full", 0, Trainer(_config(path), info).checkpoint_states(), model_dir=path)
    for name, cfg, ckpt in (
        ("other_base", _lora(other), saved),
        ("other_alpha", _lora(path, **{"model.lora_alpha": 4.0}), saved),
        ("full_into_lora", _lora(path), full_saved),
        ("lora_into_full", _config(path), saved),
    ):
        try:
            load_checkpoint(ckpt, Trainer(cfg, info).checkpoint_states())
        except ValueError as e:
            out["errors"][name] = str(e)
    return out


def _critic(path, info, directory) -> dict:
    """A LoRA critic (gae): what trains, its third rollout's gradients beside those of a full critic
    holding its merged weights, and its checkpoint, saved after two rollouts and resumed."""
    from colocate.checkpoint import load_checkpoint, save_checkpoint
    from colocate.trainer import Trainer
    from colocate.trainer.parallelize import copy_full_

    samples = _samples(vocab=101)
    lora = Trainer(_lora(path, **GAE), info)
    model = lora.critic.model
    base = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
    out = dict(
        trained=sorted(n for n, p in model.named_parameters() if p.requires_grad), num_state=len(lora.critic.opt.optimizer.state)
    )
    for rollout_id in range(2):  # the value head moves first, then B, then A
        lora.train(samples, rollout_id=rollout_id)
    weights = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    out["base_moved"] = [n for n, t in base.items() if not torch.equal(weights[n], t)]
    out["saved"] = save_checkpoint(directory / "critic", 1, lora.checkpoint_states(), model_dir=path)
    out["weights"], out["grads"] = weights, capture_grads(lora, "critic")
    out["metrics"] = lora.train(samples, rollout_id=2)

    full = Trainer(_config(path, **GAE), info)
    for name, p in full.critic.model.named_parameters():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in weights:
            a, b = weights[f"{module}.lora_A.weight"], weights[f"{module}.lora_B.weight"]
            copy_full_(p, weights[name] + (ALPHA / RANK) * b @ a)
        else:
            copy_full_(p, weights[name])
    out["full_grads"] = capture_grads(full, "critic")
    full.train(samples, rollout_id=2)

    resumed = Trainer(_lora(path, **GAE), info)
    load_checkpoint(out["saved"], resumed.checkpoint_states())
    out["resumed_metrics"] = resumed.train(samples, rollout_id=2)
    return out


def _one_rank(rank, world_size, path, out_file):
    from colocate import dist

    torch.set_num_threads(1)
    info = dist.get_info()
    torch.save(
        dict(
            two_steps=_two_steps(path, info, _samples(vocab=101)),
            start=_start_and_push(path, info),
            reference=_reference(path, info),
            variants=_recompute_and_compile(path, info, out_file.parent),
            resume=_resume(path, info, out_file.parent),
            critic=_critic(path, info, out_file.parent),
        ),
        out_file,
    )


def _two_ranks(rank, world_size, path, out_file):
    from colocate import dist

    torch.set_num_threads(1)
    from colocate.trainer import Trainer

    samples = _samples(vocab=101)
    half = len(samples) // world_size
    mine = samples[rank * half : (rank + 1) * half]
    result = _two_steps(path, dist.get_info(), mine)
    critic = Trainer(_lora(path, **GAE), dist.get_info())  # as _critic: grads of the third rollout
    for rollout_id in range(2):
        critic.train(mine, rollout_id=rollout_id)
    result["critic_grads"] = capture_grads(critic, "critic")
    critic.train(mine, rollout_id=2)
    if rank == 0:
        torch.save(result, out_file)


@pytest.fixture(scope="module")
def one_rank(model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "results.pt"
    run_ranks(_one_rank, 1, model_path, out)
    return torch.load(out, weights_only=False)


def _assert_close(a: dict, b: dict, atol: float):
    assert set(a) == set(b) and a
    for name in a:
        assert (a[name].float() - b[name].float()).abs().max() <= atol, name


def test_step_zero_is_the_base_model_and_only_adapters_train(one_rank):
    start = one_rank["start"]
    lora, full = start["init"]
    assert torch.equal(lora, full)
    assert start["num_trained"] == 2 * 7 * 2  # A and B of 7 projections in 2 blocks
    assert start["optim_state"] == [["exp_avg", "exp_avg_sq", "step"]] * 28
    assert start["offload_sources"] == (True, 0)  # the adapters and their state never leave the device


def test_adapter_gradients_match_a_plain_torch_reference(model_path, one_rank):
    """The second step's gradient (A's is not zero once B has moved) equals the gradient of the
    GRPO loss of a plain model whose adapted weights are W + (alpha / rank) B A."""
    r = one_rank["two_steps"]
    model = from_pretrained(model_path, dtype="float32")
    leaves = {n: t.clone().requires_grad_() for n, t in r["before"].items()}
    params = dict(model.named_parameters())
    merged = {}
    for name in leaves:
        weight = name.replace(".lora_A.", ".").replace(".lora_B.", ".")
        a, b = leaves[weight.replace(".weight", ".lora_A.weight")], leaves[weight.replace(".weight", ".lora_B.weight")]
        merged[weight] = params[weight] + (ALPHA / RANK) * b @ a
    loss = plain_grpo_loss(lambda ids: torch.func.functional_call(model, merged, (ids,)), _samples(vocab=101), "token_mean")
    loss.backward()
    _assert_close(r["grads"], {n: leaf.grad for n, leaf in leaves.items()}, 1e-5)
    for name, leaf in leaves.items():  # q/k's A gradients are tiny here (~1e-7): relative too
        scale = float(leaf.grad.abs().max())
        assert scale > 0 and (r["grads"][name] - leaf.grad).abs().max() <= 1e-4 * scale, name
    _assert_close(r["before"], r["after"], 1.0)
    assert any((r["before"][n] - r["after"][n]).abs().max() > 1e-6 for n in leaves)


def test_pushed_weights_are_peft_merges_and_later_pushes_send_adapted_modules_only(model_path, one_rank):
    peft = pytest.importorskip("peft")
    import transformers

    def peft_merge(adapters):
        hf = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        config = peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        wrapped = peft.get_peft_model(hf, config)
        assert not peft.set_peft_model_state_dict(
            wrapped, {f"base_model.model.{n}": t for n, t in adapters.items()}
        ).unexpected_keys
        return {n: t for n, t in wrapped.merge_and_unload().state_dict().items() if n in engine}

    start = one_rank["start"]
    engine = start[torch.float32, "engine"]
    merged = peft_merge(start["adapters"])
    assert set(merged) == set(engine)
    for name, expected in merged.items():
        assert torch.equal(engine[name], expected), name
        assert torch.equal(start[torch.bfloat16, "engine"][name], expected.to(torch.bfloat16)), name
    first, partial = start[torch.float32, "stats"], start["partial_stats"]
    assert not first.partial and first.num_tensors == len(engine)  # the tied lm_head is not a parameter here
    assert partial.partial and partial.num_tensors == 14
    merged = peft_merge(start["partial_adapters"])
    for name, expected in merged.items():
        assert torch.equal(start["partial_engine"][name], expected), name


def test_reference_is_the_base_through_the_actor_model(one_rank):
    r = one_rank["reference"]
    assert r["shared"]
    first, second = r["metrics"]
    assert 0.0 < first["train/kl_loss"] < 1e-3  # step 1 of 2 is exactly the base (KL 0), step 2 moved
    assert second["train/kl_loss"] > first["train/kl_loss"]


def test_recomputed_compiled_and_dropout_gradients(one_rank):
    v = one_rank["variants"]
    _assert_close(v["eager"], v["full"], 1e-6)
    _assert_close(v["eager"], v["mlp"], 1e-6)
    _assert_close(v["qwen3", True], v["qwen3", False], 1e-6)
    # Recomputation replays the dropout masks of the forward (the RNG state is kept for it).
    _assert_close(v["dropout", True], v["dropout", False], 1e-6)
    assert any((v["dropout", False][n] - v["eager"][n]).abs().max() > 1e-4 for n in v["eager"])


def test_checkpoint_holds_adapters_and_resumes_exactly(one_rank):
    from torch.distributed.checkpoint import FileSystemReader

    r = one_rank["resume"]
    first, second = r["metrics"]
    for key in ("train/pg_loss", "train/grad_norm", "train/lr"):
        assert first[key] == second[key], key
    _assert_close(*r["adapters"], 0.0)
    keys = FileSystemReader(str(r["saved"])).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.model.")]
    moments = [k for k in keys if k.startswith("model.optimizer.state.") and k.endswith(".exp_avg")]
    assert len(weights) == len(moments) == 28 and all(is_adapter(k) for k in weights + moments)
    assert "model.lora" in keys


def test_checkpoint_of_another_base_or_kind_is_refused(one_rank, model_path):
    errors = one_rank["resume"]["errors"]
    assert set(errors) == {"other_base", "other_alpha", "full_into_lora", "lora_into_full"}
    assert errors["other_base"].startswith(f"the checkpoint's LoRA adapters were trained on the base {model_path} ")
    assert "not on this run's base" in errors["other_base"] and "qwen2 (config.json SHA-256" in errors["other_base"]
    assert errors["other_alpha"] == "the checkpoint's LoRA adapters have alpha 8.0, this run's model.lora_alpha is 4.0"
    assert errors["full_into_lora"].endswith("'model' is a whole model, not LoRA adapters (it was saved with model.lora_rank 0)")
    assert errors["lora_into_full"].endswith(
        f"'model' holds LoRA adapters of rank 4 on the base {model_path}; resume it with model.lora_rank 4"
    )


def test_critic_trains_adapters_and_value_head_on_a_frozen_base(one_rank):
    c = one_rank["critic"]
    adapters = [n for n in c["weights"] if is_adapter(n)]
    assert c["trained"] == sorted(adapters + ["value_head.bias", "value_head.weight"])
    assert len(c["trained"]) == 2 * 7 * 2 + 2 == c["num_state"]
    assert c["base_moved"] == []
    assert all(c["weights"][n].abs().max() > 0 for n in c["trained"] if ".lora_B." in n or "value_head" in n)


def test_critic_adapter_gradients_follow_the_full_critic_of_the_merged_weights(one_rank):
    """dL/dB = s G A^T and dL/dA = s B^T G, with G the gradient of the same value loss with
    respect to the merged weight W + s B A (a full critic holding those weights)."""
    c = one_rank["critic"]
    weights, full, scale = c["weights"], c["full_grads"], ALPHA / RANK
    expected = {n: full[n] for n in ("value_head.weight", "value_head.bias")}
    for name in c["trained"]:
        if ".lora_A." in name:
            module = name.removesuffix(".lora_A.weight")
            g, a, b = full[f"{module}.weight"], weights[name], weights[f"{module}.lora_B.weight"]
            expected[name], expected[f"{module}.lora_B.weight"] = scale * b.T @ g, scale * g @ a.T
    assert set(expected) == set(c["grads"])
    for name, grad in c["grads"].items():
        top = float(expected[name].abs().max())
        assert top > 0 and (grad - expected[name]).abs().max() <= 1e-4 * top, name


def test_critic_checkpoint_holds_its_adapters_and_head_and_resumes_exactly(one_rank):
    from torch.distributed.checkpoint import FileSystemReader

    c = one_rank["critic"]
    for key in ("critic/value_loss", "critic/grad_norm", "train/pg_loss"):
        assert c["metrics"][key] == c["resumed_metrics"][key], key
    keys = FileSystemReader(str(c["saved"])).read_metadata().state_dict_metadata
    weights = sorted(k.removeprefix("critic.model.") for k in keys if k.startswith("critic.model."))
    assert weights == c["trained"] and "critic.lora" in keys


def test_exports_give_the_trainer_logits_in_transformers_and_peft(one_rank, model_path, tmp_path):
    import transformers

    from colocate.export import export
    from colocate.export import main as export_main

    r = one_rank["resume"]
    ids, expected = r["ids"], r["logits_at_save"]
    merged = export(r["saved"], tmp_path / "merged", dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        assert (hf(ids[None]).logits[0] - expected).abs().max() <= 1e-5
    assert json.loads((merged / "tokenizer_config.json").read_text()) == {"model_max_length": 256}

    peft = pytest.importorskip("peft")
    assert export_main([str(r["saved"]), str(tmp_path / "adapter"), "--adapter-only", "--dtype", "float32"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert (wrapped(ids[None]).logits[0] - expected).abs().max() <= 1e-5
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == RANK
    with pytest.raises(ValueError, match="base model .* is not the one the adapters were trained on"):
        export(r["saved"], tmp_path / "wrong", base=write_hf_model(tmp_path, "qwen3")[0])


def test_two_ranks_equal_one_process(model_path, one_rank, tmp_path):
    run_ranks(_two_ranks, 2, model_path, tmp_path / "two.pt")
    two, one = torch.load(tmp_path / "two.pt", weights_only=False), one_rank["two_steps"]
    # 12 tensors per block (q/k/v weights and biases, 4 more projections, 2 norms), the embeddings and
    # the final norm (the tied head is the embeddings); adapted weights merged, no adapter sent.
    assert len(one["pushed"]) == 26 and not any(is_adapter(n) for n in one["pushed"])
    _assert_close(one["grads"], two["grads"], 1e-5)
    _assert_close(one["after"], two["after"], 1e-5)
    _assert_close(one["pushed"], two["pushed"], 1e-5)
    assert abs(one["metrics"]["train/grad_norm"] - two["metrics"]["train/grad_norm"]) < 1e-5
    critic_one, critic_two = one_rank["critic"]["grads"], two["critic_grads"]  # the LoRA critic's, too
    assert set(critic_one) == set(critic_two)
    for name, grad in critic_one.items():  # relative: A's gradients are ~1e-8 here
        assert (grad - critic_two[name]).abs().max() <= 1e-4 * grad.abs().max(), name


def _cuda_rank(rank, world_size, path, keep_adapters):
    """bf16 compute, pinned offload and the log-prob kernel on one GPU, with a LoRA critic; a push
    into a bf16 engine. The frozen base goes to the host at the first offload only, and comes back
    unchanged from every later one; the adapters and their state stay on the device with
    offload.keep_adapters, and go to the host and back with the base otherwise."""
    from colocate import dist
    from colocate.colocation.weight_sync import sync_weights
    from colocate.lora.merge import merged_weight
    from colocate.rollout.native import NativeEngine
    from colocate.trainer import Trainer
    from colocate.trainer.lora import adapted_modules, adapters_disabled
    from colocate.trainer.memory import ACTOR_OPTIM, PARAMS, STATE

    info = dist.get_info()
    overrides = {"model.dtype": "auto", "offload.offload_train": True, "model.gradient_checkpointing": True}
    trainer = Trainer(_lora(path, **overrides, **GAE, **{"offload.keep_adapters": keep_adapters}), info)
    full = Trainer(_config(path, **overrides), info)
    assert trainer.compute_dtype == torch.bfloat16
    ids = torch.tensor(_samples(vocab=101)[0].tokens, device=info.device)
    assert torch.equal(_logits(trainer, ids), _logits(full, ids))
    for name, p in trainer.actor_module.named_parameters():
        assert p.dtype == (torch.float32 if is_adapter(name) else torch.bfloat16), name
    for name, p in trainer.critic.model.named_parameters():
        trained = is_adapter(name) or name.startswith("value_head.")
        assert p.dtype == (torch.float32 if trained else torch.bfloat16), name
    for rollout_id in range(2):
        trainer.memory.onload(*PARAMS, *STATE, overlap=True)
        assert torch.isfinite(torch.tensor(trainer.train(_samples(vocab=101), rollout_id)["train/grad_norm"]))
        moved = trainer.memory.offload(ACTOR_OPTIM).num_bytes
        adapter_bytes = sum(p.to_local().nbytes for n, p in trainer.actor_module.named_parameters() if is_adapter(n))
        if keep_adapters:
            assert moved == 0
        else:
            assert 2 * adapter_bytes <= moved < 2 * adapter_bytes + (64 << 10)  # two fp32 moments and step counts
        storage_bytes = {n: p.to_local().untyped_storage().nbytes() for n, p in trainer.actor_module.named_parameters()}
        trained_bytes = sum(b for n, b in storage_bytes.items() if is_adapter(n))
        moved = trainer.memory.offload(*PARAMS).num_bytes
        first = sum(storage_bytes.values()) - (trained_bytes if keep_adapters else 0)
        assert moved == (first if rollout_id == 0 else 0 if keep_adapters else trained_bytes), rollout_id
        left = {n: p.to_local().untyped_storage().nbytes() for n, p in trainer.actor_module.named_parameters()}
        assert all(b == (storage_bytes[n] if keep_adapters and is_adapter(n) else 0) for n, b in left.items())
        moments = [
            v for state in trainer.actor.opt.optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.is_cuda
        ]
        local = [v.to_local() if hasattr(v, "to_local") else v for v in moments]
        assert local and all(bool(v.untyped_storage().nbytes()) == keep_adapters for v in local)
    trainer.memory.onload(*PARAMS)
    with adapters_disabled(trainer.actor_module):  # the base, after two offloads without a copy
        assert torch.equal(_logits(trainer, ids), _logits(full, ids))
    engine = NativeEngine(str(path), dtype=torch.bfloat16, max_kv_tokens=256)
    sync_weights(trainer.actor_module, engine, version=1, dtype=torch.bfloat16)
    got = dict(engine.model.named_parameters())
    for name, m in adapted_modules(trainer.actor_module):
        expected = merged_weight(
            m.weight.full_tensor(), m.lora_A.weight.full_tensor(), m.lora_B.weight.full_tensor(), m.scale, torch.bfloat16
        )
        assert torch.equal(got[f"{name}.weight"], expected), name


@pytest.mark.gpu
@pytest.mark.parametrize("keep_adapters", [True, False], ids=["adapters_stay", "adapters_move"])
def test_gpu_bf16_lora_steps_offload_and_push(model_path, keep_adapters):
    run_ranks(_cuda_rank, 1, model_path, keep_adapters)
