"""Checkpoint save/resume (FSDP2 + AdamW on gloo, 1 and 2 ranks), crash safety, pruning, HF export."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import colocate.checkpoint as ckpt_mod
from colocate import dist as cdist
from colocate.checkpoint import ModelOptimizerState, load_checkpoint, save_checkpoint
from colocate.checkpoint_manifest import latest_checkpoint
from colocate.export import export
from colocate.export import main as export_main
from colocate.models import ArchConfig, from_config, from_pretrained, load_weights
from tests.helpers import write_hf_model

VOCAB = 101


def _build(model_dir, shard: bool, fresh: bool, device="cpu"):
    """The tiny model (the HF weights, or a different random init when `fresh`), AdamW and a warmup."""
    if fresh:
        torch.manual_seed(1234)
        model = from_config(ArchConfig.from_dir(model_dir), device=device, init=True)
    else:
        model = from_pretrained(model_dir, dtype="float32", device=device)
    if shard:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched


def _step(model, opt, sched, device="cpu"):
    """One optimizer step on a batch drawn from the global torch RNG (so RNG restore matters)."""
    ids = torch.randint(0, VOCAB, (2, 12), device=device)  # (B, T)
    logits = model(ids)  # (B, T, V)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for n, p in model.named_parameters()}


def _draws(device="cpu") -> list[float]:
    return [torch.rand((), device=device).item(), torch.rand(()).item(), random.random(), float(np.random.rand())]


def _run_and_resume(model_dir, root, extra, device="cpu"):
    """Train 2 steps, save, 1 more step; then a fresh model resumes from the save and takes that step.

    Returns (params at save, params after step 3, resumed params after step 3, draws, resumed draws,
    extra read back, lr after step 3, resumed lr). Collective: every rank of the group calls it.
    """
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model, opt, sched = _build(model_dir, shard=True, fresh=False, device=device)
    for _ in range(2):
        _step(model, opt, sched, device)
    path = save_checkpoint(
        root, 2, {"model": ModelOptimizerState(model, opt, sched)}, extra=extra, model_dir=model_dir, keep_last=2
    )
    at_save = _full(model)
    draws = _draws(device)
    _step(model, opt, sched, device)
    after, lr = _full(model), sched.get_last_lr()
    del model, opt, sched

    torch.manual_seed(99)  # a different RNG state that the load must overwrite
    random.seed(99)
    np.random.seed(99)
    model, opt, sched = _build(model_dir, shard=True, fresh=True, device=device)
    got_extra = load_checkpoint(path, {"model": ModelOptimizerState(model, opt, sched)})
    resumed_draws = _draws(device)
    _step(model, opt, sched, device)
    return at_save, after, _full(model), draws, resumed_draws, got_extra, lr, sched.get_last_lr()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path, _ = write_hf_model(tmp_path_factory.mktemp("hf"), "qwen2")  # tied embeddings, q/k/v biases
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    return path


@pytest.fixture
def world1_group():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def world1_run(model_dir, tmp_path_factory):
    """The resume scenario once on a world-1 gloo group, shared by the resume and export tests."""
    root = tmp_path_factory.mktemp("ckpt1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = _run_and_resume(model_dir, root, {"rollout_id": 2, "data": {"epoch": 0, "offset": 16}})
    finally:
        dist.destroy_process_group()
    return root, result


def test_resume_world1_is_exact(world1_run):
    root, (at_save, after, resumed, draws, resumed_draws, extra, lr, resumed_lr) = world1_run
    assert extra == {"rollout_id": 2, "data": {"epoch": 0, "offset": 16}}
    assert resumed_draws == draws  # python, numpy and torch RNG restored
    assert resumed_lr == lr == [1e-2]  # scheduler restored (warmup reached step 3 of 4)
    for name in after:
        assert torch.equal(resumed[name], after[name]), name
    assert any(not torch.equal(at_save[n], after[n]) for n in after)  # the step changed the weights
    assert latest_checkpoint(root) == root / "rollout_000002"
    assert sorted(p.name for p in root.iterdir()) == ["rollout_000002"]
    assert sorted(p.name for p in (root / "rollout_000002" / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
    ]


def _worker(rank, store_file, model_dir, root, out, device_type="cpu"):
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store_file}", rank=rank, world_size=2
    )
    result = _run_and_resume(model_dir, root, {"rollout_id": 2}, device)
    if rank == 0:
        torch.save(result, out)
    cdist.destroy()
    cdist.exit_process(0)


def test_two_ranks_resume_exact_and_reshard_to_one(model_dir, tmp_path):
    import torch.multiprocessing as mp

    root, out = tmp_path / "ckpt", tmp_path / "result.pt"
    mp.spawn(_worker, args=(str(tmp_path / "store"), model_dir, root, out), nprocs=2)
    at_save, after, resumed, draws, resumed_draws, extra, lr, resumed_lr = torch.load(out)
    assert extra == {"rollout_id": 2} and resumed_draws == draws and resumed_lr == lr
    for name in after:
        assert torch.equal(resumed[name], after[name]), name
    path = root / "rollout_000002"
    assert {p.name for p in path.glob("rng_rank*.pt")} == {"rng_rank0.pt", "rng_rank1.pt"}

    # Without a process group, a plain model loads the 2-rank shards (DCP reshards); RNG is skipped.
    model, opt, sched = _build(model_dir, shard=False, fresh=True)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match="world size 2, loading with 1.*RNG state is not restored"):
        load_checkpoint(path, {"model": ModelOptimizerState(model, opt, sched)})
    assert torch.equal(torch.get_rng_state(), before)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), at_save[name]), name
    assert sched.last_epoch == 2 and all(s["step"] == 2 for s in opt.state.values())


def test_resume_into_world1_group_from_world1_save(model_dir, tmp_path, world1_group):
    """Both save and load of FSDP2 DTensors on a group of one; also optimizer state equal."""
    model, opt, sched = _build(model_dir, shard=True, fresh=False)
    _step(model, opt, sched)
    path = save_checkpoint(tmp_path, 1, {"model": ModelOptimizerState(model, opt, sched)})
    fresh, fresh_opt, fresh_sched = _build(model_dir, shard=True, fresh=True)
    load_checkpoint(path, {"model": ModelOptimizerState(fresh, fresh_opt, fresh_sched)})
    assert len(opt.state) == len(fresh_opt.state) == len(list(model.parameters()))
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(a["exp_avg_sq"].full_tensor(), b["exp_avg_sq"].full_tensor())
    want, got = _full(model), _full(fresh)
    assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())


def _tiny_state(seed: int):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(3, 2)
    return {"model": ModelOptimizerState(layer, torch.optim.SGD(layer.parameters(), lr=0.1))}, layer


def test_keep_last_prunes_only_its_own_older_checkpoints(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "rollout_000000").mkdir()  # not a checkpoint: kept, skipped with a warning
    for i in (1, 2, 3, 4):
        save_checkpoint(tmp_path, i, _tiny_state(i)[0], keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["notes", "rollout_000000", "rollout_000003", "rollout_000004"]
    # A re-save of an older id is the newest written, so it survives although its id is lowest.
    save_checkpoint(tmp_path, 2, _tiny_state(2)[0], keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("rollout_00000[1-4]")) == ["rollout_000002", "rollout_000003", "rollout_000004"]
    with pytest.warns(UserWarning, match="rollout_000000: skipped"):
        assert latest_checkpoint(tmp_path) == tmp_path / "rollout_000004"


def test_crash_before_rename_keeps_previous_checkpoint(tmp_path, monkeypatch):
    states, layer = _tiny_state(0)
    save_checkpoint(tmp_path, 1, states, extra={"step": 1})
    saved = layer.weight.detach().clone()

    def crash(tmp, final):
        raise RuntimeError("killed")

    monkeypatch.setattr(ckpt_mod, "_publish", crash)
    with torch.no_grad():
        layer.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="killed"):
        save_checkpoint(tmp_path, 2, states, extra={"step": 2})
    assert (tmp_path / ".tmp-rollout_000002" / ".metadata").is_file()  # written, never published
    assert latest_checkpoint(tmp_path) == tmp_path / "rollout_000001"
    assert load_checkpoint(tmp_path / "rollout_000001", states) == {"step": 1}
    assert torch.equal(layer.weight, saved)

    monkeypatch.undo()
    save_checkpoint(tmp_path, 3, states)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout_000001", "rollout_000003"]


def test_bad_paths_and_incompatible_states_are_named(tmp_path):
    states, _ = _tiny_state(0)
    with pytest.raises(ValueError, match="extra must be JSON-able"):
        save_checkpoint(tmp_path, 0, states, extra={"x": object()})
    with pytest.raises(ValueError, match="model_dir .*no config.json"):
        save_checkpoint(tmp_path, 0, states, model_dir=tmp_path)
    path = save_checkpoint(tmp_path, 0, states)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", states)
    with pytest.raises(ValueError, match="is not a checkpoint.*pass one of them"):
        load_checkpoint(tmp_path, states)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"shapes differ.*model\.model\.weight \(2, 3\) vs \(2, 4\)"):
        load_checkpoint(path, {"model": ModelOptimizerState(other)})
    with pytest.raises(ValueError, match=r"missing keys \['critic\.model\.weight'"):
        load_checkpoint(path, {"critic": ModelOptimizerState(torch.nn.Linear(3, 2))})
    with pytest.raises(ValueError, match="has no hf/config.json"):
        export(path, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a checkpoint"):
        export(tmp_path / "empty", tmp_path / "out")
    assert export_main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2


def test_export_loads_in_transformers_with_equal_logits(world1_run, tmp_path):
    import transformers

    root, (at_save, *_) = world1_run
    out = export(root, tmp_path / "hf_fp32", dtype="float32")  # a root: its newest checkpoint
    ours = from_config(ArchConfig.from_dir(out))
    load_weights(ours, at_save.items())
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-5
    assert torch.equal(hf.model.embed_tokens.weight, at_save["model.embed_tokens.weight"])
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 256}

    assert export_main([str(root / "rollout_000002"), str(tmp_path / "hf_bf16")]) == 0
    bf16 = from_pretrained(tmp_path / "hf_bf16", dtype="bfloat16")
    assert json.loads((tmp_path / "hf_bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for name, p in bf16.named_parameters():
        assert torch.equal(p, at_save[name].to(torch.bfloat16)), name


@pytest.mark.gpu
def test_gpu_resume_world1_nccl_is_exact(model_dir, tmp_path):
    """FSDP2 on CUDA with nccl: exact resume, CUDA generator included (the first of the draws)."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        _, after, resumed, draws, resumed_draws, *_ = _run_and_resume(model_dir, tmp_path, {}, "cuda")
    finally:
        dist.destroy_process_group()
    assert resumed_draws == draws
    assert all(torch.equal(resumed[n], after[n]) for n in after)
    assert torch.load(tmp_path / "rollout_000002" / "rng_rank0.pt", weights_only=True)["cuda"].numel() > 0


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_two_ranks_nccl_resume_exact(model_dir, tmp_path):
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    root, out = tmp_path / "ckpt", tmp_path / "result.pt"
    mp.spawn(_worker, args=(str(tmp_path / "store"), model_dir, root, out, "cuda"), nprocs=2)
    _, after, resumed, draws, resumed_draws, *_ = torch.load(out)
    assert resumed_draws == draws
    assert all(torch.equal(resumed[n], after[n]) for n in after)
