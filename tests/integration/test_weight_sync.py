import torch
from torch.distributed.fsdp import fully_shard

from colocate.colocation.weight_sync import fsdp_units, sync_weights
from colocate.models import from_pretrained
from tests.distributed import run_ranks
from tests.helpers import write_hf_model


class RecordingEngine:
    """Records what a weight sync hands over, and when."""

    casts_on_update = False

    def __init__(self):
        self.weight_version = 0
        self.buckets, self.session = [], False

    def begin_weight_update(self):
        assert not self.session
        self.session = True

    def update_weights(self, named):
        assert self.session, "update outside a session"
        self.buckets.append([(n, t.clone()) for n, t in named])

    def end_weight_update(self, version):
        self.session, self.weight_version = False, version


def _sync_on_ranks(rank, world_size, path, out_file):
    model = from_pretrained(path, dtype="float32")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = RecordingEngine()
    stats = sync_weights(model, engine, version=3, dtype=torch.bfloat16, bucket_bytes=4096)
    received = {n: t for b in engine.buckets for n, t in b}
    assert len(received) == stats.num_tensors == sum(len(b) for b in engine.buckets)
    assert all(type(t) is torch.Tensor for t in received.values()), "a DTensor leaked to the engine"
    assert engine.weight_version == 3 and stats.num_buckets == len(engine.buckets)
    # Parameters are sharded again afterwards: no full copy stays alive in the trainer.
    assert all(hasattr(p, "full_tensor") for p in model.parameters())
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
    model = from_pretrained(path, dtype="float32")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    units = fsdp_units(model)
    names = [full for _, names in units for full, _ in names]
    assert len(names) == len(set(names)) == len(list(model.parameters()))
    assert units[0][0] is model.model.layers[0] and units[-1][0] is model
    assert [n for n, _ in units[-1][1]] == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def _sync_one_rank_into_a_casting_engine(rank, world_size, path):
    model = from_pretrained(path, dtype="float32")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine = RecordingEngine()
    engine.casts_on_update = True
    stats = sync_weights(model, engine, version=1, dtype=torch.bfloat16, bucket_bytes=1 << 20)
    received = {n: t for b in engine.buckets for n, t in b}
    # One rank holds whole tensors: nothing is gathered, the fp32 masters go to the engine to cast.
    assert all(t.dtype == torch.float32 and type(t) is torch.Tensor for t in received.values())
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    assert all(torch.equal(received[n], full[n]) for n in received)
    assert stats.num_bytes == sum(t.numel() * 2 for t in received.values())  # counted in bf16


def test_one_rank_hands_over_masters_to_a_casting_engine(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_sync_one_rank_into_a_casting_engine, 1, path)


def _sync_after_optimizer_steps(rank, world_size, path):
    from colocate.rollout.native import NativeEngine

    model = from_pretrained(path, dtype="float32")
    engine = NativeEngine(model, max_kv_tokens=256)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12)[None] % model.config.vocab_size
    for version in (1, 2):  # the unit plan is cached at the first sync: the second must see new values
        with torch.enable_grad():
            model(ids).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sync_weights(model, engine, version=version, dtype=torch.float32)
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        got = dict(engine.model.named_parameters())
        assert all(torch.equal(got[n], full[n]) for n in full), f"stale engine weights after sync {version}"


def test_cached_plan_syncs_updated_weights(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_sync_after_optimizer_steps, 1, path)
