import pytest
import torch
from torch.distributed.fsdp import fully_shard

from colocate.colocation.weight_sync import fsdp_units, sync_weights
from colocate.models import from_pretrained
from tests.distributed import run_ranks
from tests.helpers import write_hf_model


def _shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _masters(model) -> dict:
    """The trainer's full fp32 tensors by HF name (a tied lm_head once, under the embeddings' name)."""
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in model.named_parameters()}


def _assert_covers(received: dict, masters: dict, dtype: torch.dtype) -> None:
    """Every parameter arrived, each equal to its master cast to the engine dtype `dtype`."""
    assert set(received) == set(masters), f"not synced: {sorted(set(masters) - set(received))}"
    for name, t in received.items():
        assert t.shape == masters[name].shape, name
        assert torch.equal(t.to(dtype), masters[name].to(dtype)), name


class RecordingEngine:
    """Records what a weight sync hands over, and when."""

    casts_on_update = False

    def __init__(self):
        self.weight_version = 0
        self.buckets, self.session = [], False

    def begin_weight_update(self, partial=False):
        assert not self.session
        self.session, self.partial = True, partial

    def update_weights(self, named):
        assert self.session, "update outside a session"
        self.buckets.append([(n, t.clone()) for n, t in named])

    def end_weight_update(self, version):
        self.session, self.weight_version = False, version


def _sync_on_ranks(rank, world_size, path, out_file):
    model = _shard(from_pretrained(path, dtype="float32"))
    engine = RecordingEngine()
    stats = sync_weights(model, engine, version=3, dtype=torch.bfloat16, bucket_bytes=4096)
    received = {n: t for b in engine.buckets for n, t in b}
    assert len(received) == stats.num_tensors == sum(len(b) for b in engine.buckets)
    assert all(type(t) is torch.Tensor for t in received.values()), "a DTensor leaked to the engine"
    assert engine.weight_version == 3 and stats.num_buckets == len(engine.buckets)
    # Parameters are sharded again afterwards: no full copy stays alive in the trainer.
    assert all(hasattr(p, "full_tensor") for p in model.parameters())
    _assert_covers(received, _masters(model), torch.bfloat16)
    if rank == 0:
        torch.save(received, out_file)


def test_fsdp_sync_hands_over_every_full_tensor_in_engine_dtype(tmp_path):
    path, hf = write_hf_model(tmp_path, "qwen2")  # tied embeddings: lm_head is not sent twice
    out_file = tmp_path / "received.pt"
    run_ranks(_sync_on_ranks, 2, path, out_file)
    received = torch.load(out_file)
    expected = {n: p.detach() for n, p in hf.named_parameters()}
    assert set(received) == set(expected)
    for name, t in received.items():
        assert t.dtype == torch.bfloat16 and t.shape == expected[name].shape, name
        assert torch.equal(t, expected[name].to(torch.bfloat16)), name


def test_units_cover_each_parameter_once_blocks_first(tmp_path):
    path, _ = write_hf_model(tmp_path, "llama")
    model = from_pretrained(path, dtype="float32")
    units = fsdp_units(model)  # not sharded: one unit, the model itself
    assert len(units) == 1 and len(units[0][1]) == len(list(model.parameters()))
    run_ranks(_units_sharded, 1, path)


def _units_sharded(rank, world_size, path):
    model = _shard(from_pretrained(path, dtype="float32"))
    units = fsdp_units(model)
    names = [full for _, names in units for full, _ in names]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert units[0][0] is model.model.layers[0] and units[-1][0] is model
    assert [n for n, _ in units[-1][1]] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def _sync_one_rank_into_a_casting_engine(rank, world_size, path):
    model = _shard(from_pretrained(path, dtype="float32"))
    engine = RecordingEngine()
    engine.casts_on_update = True
    stats = sync_weights(model, engine, version=1, dtype=torch.bfloat16, bucket_bytes=1 << 20)
    received = {n: t for b in engine.buckets for n, t in b}
    # One rank holds whole tensors: nothing is gathered, the fp32 masters go to the engine to cast.
    assert all(t.dtype == torch.float32 and type(t) is torch.Tensor for t in received.values())
    _assert_covers(received, _masters(model), torch.float32)
    assert stats.num_bytes == sum(t.numel() * 2 for t in received.values())  # counted in bf16
    # An engine that does not cast gets every tensor cast to its dtype by the sync.
    plain = RecordingEngine()
    sync_weights(model, plain, version=2, dtype=torch.bfloat16, bucket_bytes=1 << 20)
    received = {n: t for b in plain.buckets for n, t in b}
    assert all(t.dtype == torch.bfloat16 for t in received.values())
    _assert_covers(received, _masters(model), torch.bfloat16)


def test_one_rank_hands_over_masters_to_a_casting_engine(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_sync_one_rank_into_a_casting_engine, 1, path)


def _sync_after_optimizer_steps(rank, world_size, path):
    from colocate.rollout.native import NativeEngine

    model = from_pretrained(path, dtype="float32")
    engine = NativeEngine(model, max_kv_tokens=256)
    _shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12)[None] % model.config.vocab_size
    for version in (1, 2):  # the unit plan is cached at the first sync: the second must see new values
        with torch.enable_grad():
            model(ids).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sync_weights(model, engine, version=version, dtype=torch.float32)
        _assert_covers({n: p.detach() for n, p in engine.model.named_parameters()}, _masters(model), torch.float32)


def test_cached_plan_syncs_updated_weights(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_sync_after_optimizer_steps, 1, path)


def _sync_into_native_engines(rank, world_size, path, dtype):
    """A native engine in a half dtype, loaded from disk, takes weights the trainer has since changed:
    afterwards every engine parameter must hold the cast of the new master."""
    from colocate.rollout.native import NativeEngine

    model = from_pretrained(path, dtype="float32")
    g = torch.Generator().manual_seed(5)  # the same change on every rank
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    engine = NativeEngine(str(path), dtype=dtype, max_kv_tokens=256)
    stale = {n: p.clone() for n, p in engine.model.named_parameters()}
    _shard(model)
    sync_weights(model, engine, version=1, dtype=dtype, bucket_bytes=8192)
    got = {n: p.detach() for n, p in engine.model.named_parameters()}
    assert all(t.dtype == dtype for t in got.values())
    _assert_covers(got, _masters(model), dtype)
    assert all(not torch.equal(got[n], stale[n]) for n in got)  # each one was written by the sync


def test_every_native_engine_parameter_holds_the_cast_master(tmp_path):
    """One rank (whole tensors, cast by the engine) into bf16; two ranks (gathered units) into fp16."""
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_sync_into_native_engines, 1, path, torch.bfloat16)
    run_ranks(_sync_into_native_engines, 2, path, torch.float16)


def _sync_into_an_fp8_engine(rank, world_size, path):
    """An engine with FP8 weights (rollout.weight_dtype fp8) takes the trainer's changed weights in
    buckets: every projection must hold quantize_rowwise(master) (values and row scales), every other
    parameter the master itself."""
    from colocate.kernels.fp8 import E4M3, quantize_rowwise
    from colocate.rollout.native import NativeEngine

    model = from_pretrained(path, dtype="float32")
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    engine = NativeEngine(str(path), max_kv_tokens=256, weight_dtype="fp8")
    _shard(model)
    sync_weights(model, engine, version=1, dtype=torch.float32, bucket_bytes=8192)
    got = dict(engine.model.named_parameters())
    masters = _masters(model)
    quantized = [n for n in masters if got[n].dtype == E4M3]
    assert len(quantized) == 2 * 7
    for name, master in masters.items():
        if name in quantized:
            w8, scale = quantize_rowwise(master)
            assert torch.equal(got[name].view(torch.uint8), w8.view(torch.uint8)), name
            assert torch.equal(got[name + "_scale"], scale), name
        else:
            assert torch.equal(got[name], master), name


def test_an_fp8_engine_holds_the_quantized_masters_after_a_sync(tmp_path):
    """One rank (whole tensors) and two (gathered units)."""
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_sync_into_an_fp8_engine, 1, path)
    run_ranks(_sync_into_an_fp8_engine, 2, path)


def test_native_engine_partial_update_keeps_the_rest_and_needs_complete_weights(tmp_path):
    from colocate.rollout.native import NativeEngine
    from colocate.rollout.protocol import SamplingParams

    path, _ = write_hf_model(tmp_path, "qwen2")
    engine = NativeEngine(str(path), max_kv_tokens=256)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    name = "model.layers.0.self_attn.q_proj.weight"
    new = torch.full_like(before[name], 0.5)
    engine.begin_weight_update(partial=True)
    engine.update_weights([(name, new)])
    engine.end_weight_update(3)
    after = {n: p.detach() for n, p in engine.model.named_parameters()}
    assert engine.weight_version == 3 and torch.equal(after[name], new)
    assert all(torch.equal(after[n], before[n]) for n in before if n != name)
    assert len(engine.generate([[2, 3]], SamplingParams(max_new_tokens=2))[0].output_ids) == 2
    engine.begin_weight_update()  # a full session still needs every parameter
    engine.update_weights([(name, new)])
    with pytest.raises(RuntimeError, match=r"left 25 parameters unwritten"):
        engine.end_weight_update(4)
    engine.update_weights(before.items())
    engine.end_weight_update(4)
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])  # the weights come back without their values
    with pytest.raises(RuntimeError, match="a partial weight update needs complete weights, but they were released"):
        engine.begin_weight_update(partial=True)
    engine.begin_weight_update()
    engine.update_weights(before.items())
    engine.end_weight_update(5)
    engine.begin_weight_update(partial=True)
    engine.end_weight_update(6)
    assert engine.weight_version == 6
