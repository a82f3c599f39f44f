"""Partial rollout in the whole loop (colocate.train.Loop on the toy task, CPU, gloo ranks).

- Off, a short run logs the numbers it logged before partial rollout existed; on, with as many
  groups in flight as are trained (nothing to carry), it logs the same numbers as off.
- On, with twice as many groups in flight as trained, on two ranks: a run stopped right after a
  checkpoint and resumed continues the carried samples exactly (every logged number of the steps
  that follow, the weights and the groups still in flight equal those of the uninterrupted run),
  and every drawn prompt's group trains exactly once.
- On under LoRA: carried samples resume, every push after the first sends the adapted modules only,
  the engine ends with the adapters' merges, and every drawn prompt's group trains exactly once.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from colocate.config import Config
from colocate.metrics import read_metrics
from tests.distributed import run_ranks
from tests.integration.test_resume_state import _assert_equal, _compared, assert_record_from_checkpoint, run_loop

BEFORE = [
    {
        "rollout/raw_reward": 0.0796875,
        "rollout/response_len/mean": 7.75,
        "rollout/truncated_ratio": 0.8125,
        "train/pg_loss": -0.0047665988095104694,
        "train/grad_norm": 1.7957444190979004,
        "train/entropy_loss": 1.9063349962234497,
    },
    {
        "rollout/raw_reward": 0.0796875,
        "rollout/response_len/mean": 6.0625,
        "rollout/truncated_ratio": 0.5,
        "train/pg_loss": 0.029546614736318588,
        "train/grad_norm": 2.4724488258361816,
        "train/entropy_loss": 1.7579885721206665,
    },
    {
        "rollout/raw_reward": 0.09114583333333333,
        "rollout/response_len/mean": 5.9375,
        "rollout/truncated_ratio": 0.625,
        "train/pg_loss": -0.1401595026254654,
        "train/grad_norm": 1.9826443195343018,
        "train/entropy_loss": 1.4364463090896606,
    },
]
"""What three GRPO steps of `_config(partial=False)` logged before partial rollout was added."""


def _config(toy, out, partial: bool, **rollout) -> Config:
    cfg = Config()
    cfg.output_dir = str(out)
    cfg.model.path = str(toy / "model")
    r, t = cfg.rollout, cfg.train
    r.prompt_data, r.reward = str(toy / "train.jsonl"), "toy"
    r.rollout_batch_size, r.n_samples_per_prompt, r.max_response_len, r.max_kv_tokens = 4, 4, 8, 4096
    r.partial_rollout = partial
    if partial:
        r.over_sampling_batch_size = 4
    for name, value in rollout.items():
        setattr(r, name, value)
    t.num_rollout, t.max_tokens_per_gpu, t.seed, t.lr = 3, 256, 3, 3e-3
    cfg.logging.console = False
    return cfg


def _run(cfg, stop: bool = False, record: dict | None = None):
    """The loop (see run_loop); `record` collects the prompts drawn and the groups trained
    (dataset indices) on this rank. Returns where it started, its groups in flight and weights."""
    prepare = None if record is None else (lambda loop: _record(loop, record))
    with run_loop(cfg, stop, prepare) as loop:
        in_flight = [
            (g.prompt.index, [(s.response_ids, s.rollout_logprobs, s.versions, s.finish_reason) for s in g.samples])
            for g in loop.rollout.in_flight
        ]
        weights = {
            k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
            for k, v in loop.trainer.actor_module.state_dict().items()
        }
        return loop.start_rollout_id, in_flight, weights


def _record(loop, record: dict) -> None:
    data, trainer = loop.inputs.data, loop.trainer
    next_batch, train = data.next_batch, trainer.train
    record.update(drawn=Counter(), trained=Counter())

    def drawn(n):
        prompts = next_batch(n)
        record["drawn"].update(p.index for p in prompts)
        return prompts

    def trained(samples, *args):
        n = loop.cfg.rollout.n_samples_per_prompt
        assert all([s.sample_index for s in samples[i : i + n]] == list(range(n)) for i in range(0, len(samples), n))
        record["trained"].update(s.group_index for s in samples[::n])
        return train(samples, *args)

    data.next_batch, trainer.train = drawn, trained


def _compare_runs(rank, world_size, toy, root):
    torch.set_num_threads(1)
    _run(_config(toy, root / "off", partial=False))
    _run(_config(toy, root / "on", partial=True))


@pytest.mark.slow
def test_partial_off_logs_what_it_logged_before_and_on_without_carry_the_same(tmp_path):
    from colocate.toy import ensure_toy

    toy = ensure_toy(tmp_path / "toy")
    run_ranks(_compare_runs, 1, toy, tmp_path)
    off, on = read_metrics(tmp_path / "off"), read_metrics(tmp_path / "on")
    for row, before in zip(off, BEFORE, strict=True):
        got = {k: row[k] for k in before}
        assert {k: v for k, v in got.items() if k.startswith("rollout/")} == {
            k: v for k, v in before.items() if k.startswith("rollout/")
        }
        assert got == pytest.approx(before, rel=1e-5, abs=1e-7)
        assert not any(k.startswith("rollout/partial/") for k in row)
    for a, b in zip(off, on, strict=True):
        assert {k: v for k, v in _compared(b).items() if not k.startswith("rollout/partial/")} == _compared(a)
        assert b["rollout/partial/carried_groups"] == 0 and b["rollout/partial/staleness_0"] == 1.0


NUM_ROLLOUT, STOP_AFTER = 5, 1
"""Checkpoints at rollouts 1, 3 and 4 (save_interval 2 and the last); the stopped run ends after the first."""


def _resume_config(toy, out) -> Config:
    cfg = _config(
        toy,
        out,
        partial=True,
        over_sampling_batch_size=8,
        max_response_len=40,
        reward="tests.integration.test_resume_state:noisy_toy_reward",
    )
    cfg.train.num_rollout, cfg.train.max_tokens_per_gpu = NUM_ROLLOUT, 2048
    cfg.checkpoint.save_interval, cfg.checkpoint.keep_last = 2, 3
    return cfg


def _resume_runs(rank, world_size, toy, root):
    torch.set_num_threads(1)
    record = {}
    _, full_flight, full_weights = _run(_resume_config(toy, root / "full"), record=record)
    stopped = _resume_config(toy, root / "stopped")
    _run(stopped, stop=True)
    start, flight, weights = _run(stopped)
    torch.save(
        {"record": record, "start": start, "in_flight": (full_flight, flight), "weights": (full_weights, weights)},
        root / f"rank{rank}.pt",
    )


@pytest.mark.slow
def test_resume_continues_carried_samples_and_every_group_trains_once(tmp_path):
    from colocate.toy import ensure_toy

    toy = ensure_toy(tmp_path / "toy")
    run_ranks(_resume_runs, 2, toy, tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    full = {r["step"]: r for r in read_metrics(tmp_path / "full")}
    stopped = read_metrics(tmp_path / "stopped")
    assert [r["step"] for r in stopped] == list(range(NUM_ROLLOUT))  # step 1's record from the checkpoint
    assert_record_from_checkpoint(stopped[STOP_AFTER], full[STOP_AFTER])
    resumed_rows = stopped[STOP_AFTER + 1 :]
    assert sum(r["rollout/partial/resumed_samples"] for r in resumed_rows) > 0
    assert any(r["rollout/partial/staleness_1"] > 0 for r in resumed_rows)
    for row in resumed_rows:
        assert _compared(row) == _compared(full[row["step"]]), row["step"]
    for rank in ranks:
        assert rank["start"] == STOP_AFTER + 1
        assert rank["in_flight"][0] == rank["in_flight"][1] and rank["in_flight"][0]
        _assert_equal(rank["weights"][1], rank["weights"][0], "weights")
    # Every drawn prompt: trained once, or still in flight at the end (each rank its own share).
    for rank in ranks:
        record, in_flight = rank["record"], Counter(index for index, _ in rank["in_flight"][0])
        assert max(record["trained"].values()) == 1 and sum(record["trained"].values()) == 2 * NUM_ROLLOUT
        assert record["trained"] + in_flight == record["drawn"]
    assert sum(full[s]["rollout/partial/carried_groups"] for s in full) == 4 * NUM_ROLLOUT


def _lora_partial_run(rank, world_size, toy, out):
    """A LoRA run that carries samples: the groups it drew and trained, the engine's weights at the
    end and the weights the trainer's adapters merge into (the engine's dtype)."""
    from colocate.lora.merge import merged_weight
    from colocate.trainer.lora import adapted_modules

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    torch.set_num_threads(1)
    cfg = _resume_config(toy, out)
    cfg.model.lora_rank, cfg.train.lr, cfg.checkpoint.save_interval = 8, 4e-3, None
    record = {}
    with run_loop(cfg, False, lambda loop: _record(loop, record)) as loop:
        engine = {n: p.detach().clone() for n, p in loop.engine.model.named_parameters()}
        modules = {f"{name}.weight": m for name, m in adapted_modules(loop.trainer.actor_module)}
        merged = {
            k: merged_weight(full(m.weight), full(m.lora_A.weight), full(m.lora_B.weight), m.scale, engine[k].dtype)
            for k, m in modules.items()
        }
        base = {k: full(m.weight).to(engine[k].dtype) for k, m in modules.items()}
        in_flight = Counter(g.prompt.index for g in loop.rollout.in_flight)
    torch.save(dict(record=record, in_flight=in_flight, engine=engine, merged=merged, base=base), out / "result.pt")


@pytest.mark.slow
def test_lora_carries_samples_into_pushed_merges_and_trains_every_group_once(tmp_path):
    """LoRA with partial rollout: carried samples continue under the adapters' merges, which only
    the adapted modules bring to the engine after the first push."""
    from colocate.toy import ensure_toy

    toy = ensure_toy(tmp_path / "toy")
    run_ranks(_lora_partial_run, 1, toy, tmp_path / "lora")
    result = torch.load(tmp_path / "lora" / "result.pt", weights_only=False)
    rows = read_metrics(tmp_path / "lora")
    assert sum(r["rollout/partial/resumed_samples"] for r in rows) > 0
    assert any(r["rollout/partial/staleness_1"] > 0 for r in rows)
    assert all(r["perf/sync_tensors"] == len(result["merged"]) for r in rows)  # adapted modules only
    record = result["record"]
    assert max(record["trained"].values()) == 1 and sum(record["trained"].values()) == 4 * NUM_ROLLOUT
    assert record["trained"] + result["in_flight"] == record["drawn"]
    assert result["merged"] and set(result["merged"]) < set(result["engine"])
    for name, expected in result["merged"].items():
        assert torch.equal(result["engine"][name], expected), name
    assert any(not torch.equal(result["merged"][name], base) for name, base in result["base"].items())
