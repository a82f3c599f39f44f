"""Trainer throughput on one GPU: tokens/s, MFU and peak memory of our FSDP2 trainer on packed
mixed-length sequences, side by side with transformers + FSDP2 on padded batches, in one run; the
trainer's offload/onload bandwidth for both methods, beside one plain pinned copy of the same bytes
(what this host's copies reach); with --profile, where the device time goes (by kernel category, by
op, and matmuls by input shape).

A step is one optimizer step over --step-tokens tokens (default 131072: an RL rollout batch, e.g.
32 samples of up to 4k tokens, is several micro-batches; 32768 gives one micro-batch a step).
Ours: GRPO steps through `Trainer.train` (Qwen2.5-0.5B / -1.5B shapes, random init) on packed
160..4160-token samples, bf16 compute / fp32 master weights, fused AdamW,
the Triton log-prob kernel, FlashAttention-4 where installed (else torch's varlen kernel; the JSON's
`attention` names it), compiled blocks, over a grid of activation-checkpointing plans x micro-batch
token budgets (keeping the gathered parameters through a step or not; the optimizer state resident
or, as in the colocated loop, on the host between steps). Peers (bench/train_peers.py, run
first): AutoModelForCausalLM (sdpa) + FSDP2, fused AdamW, padded micro-batches accumulated over the
same tokens a step. The default peer: 8 x 2048 with fp32 logits, eager; a 1.5B plan of ours counts
only within MEMORY_FRACTION of its peak memory. The tuned peer: a plan grid of its own (every
decoder layer recomputed or none, micro-batch size, compiled layers, liger-kernel's fused linear
cross-entropy or a chunked one, so no full logits). The best peer is the fastest configuration that
ran. torchtitan is not run (train_peers.TORCHTITAN says why; the JSON's `torchtitan` too).

MFU counts model FLOPs, never recomputation (checkpointing, the log-prob kernel's backward), the
same way for both: 6 per parameter per token, the tied embedding once, as the lm_head matmul, only
where logits are formed (ours: response tokens; peers: every position, or all but each sequence's
last with the fused loss); attention as PaLM,
12 * layers * heads * head_dim * L per token of a length-L sequence (`mfu`, the targets'
convention), or half that (`mfu_causal`, what a causal kernel computes); 989 TFLOP/s bf16 peak.
Peak memory: max_memory_allocated over the measured steps. Warm-up (compilation) is never timed.

Run: python -m bench.trainer_throughput [--models 1.5b,0.5b] [--plans 0,4] [--peer-plans 0,1] [--steps 3]
[--step-tokens 131072] [--profile] [--trace DIR] [--budget-s 420]
     python -m bench.trainer_throughput --cpu-smoke [--out PATH]   (the peers only, on a tiny shape in fp32 on CPU)
Writes bench/results/train.json (entries of models not run are kept) and, with --profile,
train_profile.txt; prints one summary line per model.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import pathlib
import random
import statistics
import time

import torch

from bench import train_peers
from bench.common import RESULTS_DIR, free_memory, guarded, machine, result_path, timed, write_result
from bench.trace_report import PHASES, busy_us, device_spans, matmul_shapes, timeline, trace_events
from bench.train_plans import (
    GRID,
    SHAPES,
    STEP_TOKENS,
    Plan,
    best_plan,
    make_samples,
    model_config,
    model_flops,
    num_params,
    trainer_config,
)
from colocate import dist
from colocate.kernels import flash
from colocate.trainer.memory import PARAMS, STATE
from colocate.trainer.packing import pack_micro_batches
from colocate.trainer.parallelize import ActivationCheckpointing

START = time.monotonic()
RESULTS = RESULTS_DIR / "train.json"
PROFILE = RESULTS_DIR / "train_profile.txt"
PEAK_TFLOPS = 989.0
MEMORY_FRACTION = 0.4
MEMORY_TARGET = ("1.5b",)
"""Models whose plans must fit in MEMORY_FRACTION of the baseline's peak (the others: speed only)."""
SECONDS_PER_PLAN = 25
"""Rough cost of one more plan whose blocks are already compiled (build, warm-up, measure)."""
SECONDS_PER_PEER_PLAN = 45
"""Rough cost of one tuned peer plan (build, compile, warm-up, measure): one runs only while this
much is left beyond what our plans and the models still to run are given."""


def _mfu(flops: float, seconds: float) -> float:
    return flops / seconds / (PEAK_TFLOPS * 1e12)


class _GcClock:
    """Seconds the Python garbage collector ran (all generations) while active."""

    def __init__(self):
        self.seconds, self._start = 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)


def _graphs() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process. A break in a block makes it run
    partly eagerly: slower, with the same numbers, so the bench records it with each plan."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values())


def _trainer(name: str, plan: Plan, info, num_samples: int, method: str = "pinned", compiled: bool = True):
    from colocate.trainer import Trainer

    return Trainer(
        trainer_config(num_samples, plan, method, compiled),
        info,
        model_config=model_config(name),
        checkpointing=ActivationCheckpointing(plan.full, plan.rest, plan.keep_attention),
    )


def bench_ours(name: str, plan: Plan, steps: int, info, limit_gib: float | None, step_tokens: int) -> tuple[dict, object]:
    mcfg = model_config(name)
    rng = random.Random(0)
    batches = [make_samples(rng, mcfg.vocab_size, step_tokens) for _ in range(2 + steps)]
    parts = [pack_micro_batches([len(s.tokens) for s in b], plan.max_tokens) for b in batches[2:]]
    base, graphs = torch.cuda.memory_allocated(), _graphs()
    trainer = _trainer(name, plan, info, len(batches[0]))
    offload_s, metrics = [], {}

    def step(batch):
        if plan.offload:
            trainer.memory.onload(*PARAMS, *STATE, overlap=True)
        metrics.update(trainer.train(batch, 1))

    def offload():
        if plan.offload:
            offload_s.append(timed(lambda: trainer.memory.offload(*STATE)))

    warmup_s = 0.0
    for batch in batches[:2]:
        warmup_s += timed(lambda b=batch: step(b))
        offload()
    offload_s.clear()
    warm_graphs = _graphs()
    torch.cuda.reset_peak_memory_stats()
    times, gc_s, tokens, flops, causal = [], [], 0, 0.0, 0.0
    for batch in batches[2:]:
        lengths = [len(s.tokens) for s in batch]
        with _GcClock() as clock:
            times.append(timed(lambda b=batch: step(b)))
        gc_s.append(clock.seconds)
        offload()
        tokens += sum(lengths)
        palm, caus = model_flops(mcfg, lengths, sum(s.response_len for s in batch))
        flops, causal = flops + palm, causal + caus
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    seconds = sum(times)
    return dict(
        compile=True,
        **plan.fields(),
        num_micro_batches=max(len(p) for p in parts),
        max_micro_batch_tokens=max(sum(len(batches[2 + i][j].tokens) for j in q) for i, p in enumerate(parts) for q in p),
        tokens_per_s=tokens / seconds,
        mfu=_mfu(flops, seconds),
        mfu_causal=_mfu(causal, seconds),
        peak_gib=peak,
        fits=None if limit_gib is None else peak <= limit_gib,
        warmup_s=warmup_s,
        step_s=times,
        gc_s=gc_s,
        step_tokens=tokens / steps,
        graphs_compiled=warm_graphs[0] - graphs[0],
        graph_breaks=warm_graphs[1] - graphs[1],
        graphs_compiled_while_measured=_graphs()[0] - warm_graphs[0],
        grad_norm=metrics.get("train/grad_norm"),
        offload_s=offload_s,
    ), trainer


def bench_offload(trainer, rounds: int = 2) -> list[dict]:
    """Offload everything, then onload, `rounds` times."""
    out = []
    for _ in range(rounds):
        off = trainer.memory.offload(*STATE, *PARAMS)
        on = trainer.memory.onload(*STATE, *PARAMS)
        out.append(
            dict(
                gib=off.num_bytes / 2**30,
                offload_s=off.seconds,
                onload_s=on.seconds,
                offload_gb_per_s=off.gb_per_s,
                onload_gb_per_s=on.gb_per_s,
            )
        )
    return out


def bench_pinned_copy(num_bytes: int, rounds: int = 3) -> dict:
    """What this host's pinned copies reach on the same bytes: one device buffer to one pinned host
    buffer and back, median of `rounds` (the offload target is a fraction of it)."""
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    to_host = statistics.median(timed(lambda: host.copy_(device, non_blocking=True)) for _ in range(rounds))
    to_device = statistics.median(timed(lambda: device.copy_(host, non_blocking=True)) for _ in range(rounds))
    return dict(gib=num_bytes / 2**30, d2h_gb_per_s=num_bytes / to_host / 1e9, h2d_gb_per_s=num_bytes / to_device / 1e9)


def _tms_offload(name: str, info) -> list[dict]:
    batch = make_samples(random.Random(1), model_config(name).vocab_size, 32768)
    trainer = _trainer(name, Plan(1.0, "none", False, 16384), info, len(batch), method="tms", compiled=False)
    trainer.train(batch, 0)
    return bench_offload(trainer)


def profile_plan(name: str, plan: Plan, info, trace_dir: str | None, step_tokens: int) -> tuple[str, dict]:
    """torch.profiler over 2 steps of one plan (after a warm-up step): tables and the timeline.
    The optimizer state stays resident: offloads between profiled steps would show up as device
    time of the steps."""
    from torch.profiler import ProfilerActivity, profile

    plan = plan._replace(offload=False)
    rng = random.Random(0)
    batches = [make_samples(rng, model_config(name).vocab_size, step_tokens) for _ in range(3)]
    trainer = _trainer(name, plan, info, len(batches[0]))
    trainer.train(batches[0], 0)
    torch.cuda.synchronize()
    light_walls = []  # device activity only: close to an unprofiled step's timing
    with profile(activities=[ProfilerActivity.CUDA]) as light:
        for batch in batches[1:]:
            light_walls.append(timed(lambda b=batch: trainer.train(b, 1)))
    light_busy = busy_us(device_spans(trace_events(light))) / 1e6
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for batch in batches[1:]:
            walls.append(timed(lambda b=batch: trainer.train(b, 1)))
    events = trace_events(prof)
    if trace_dir:
        (pathlib.Path(trace_dir) / f"train_trace_{name}.json.gz").write_bytes(
            gzip.compress(json.dumps({"traceEvents": events}).encode())
        )
    lines, summary = timeline(events)
    summary.update(device_only_step_wall_s=light_walls, device_only_busy_fraction=light_busy / sum(light_walls))
    lines.insert(
        0,
        f"device-only trace: step walls {', '.join(f'{w:.3f}' for w in light_walls)} s, device busy "
        f"{light_busy:.3f} s = {summary['device_only_busy_fraction']:.1%} of the wall time",
    )
    averages = prof.key_averages()
    phases = [e for e in averages if e.key in PHASES]
    text = [
        f"== {name}: {plan.label()}; profiled step wall times {', '.join(f'{w:.3f}' for w in walls)} s",
        *lines,
        "labelled phases (host ms total / device ms of kernels launched inside):",
        *[f"  {e.key:22s} {e.cpu_time_total / 1e3:9.1f} {e.device_time_total / 1e3:9.1f}" for e in phases],
        "top device ops by self device time:",
        averages.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70),
        "top scopes by device time of everything launched inside (compiled blocks, log-prob kernel, FSDP):",
        averages.table(sort_by="device_time_total", row_limit=25, max_name_column_width=70),
        "top host ops by self host time:",
        averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70),
        "matmuls by input shapes (which GEMM each kernel time belongs to):",
        *matmul_shapes(prof),
    ]
    return "\n".join(text), dict(summary, step_wall_s=walls, plan=plan.fields())


def _time_left(budget_s: float) -> float:
    return budget_s - (time.monotonic() - START)


def run_peers(
    label: str,
    mcfg,
    plans: list,
    args,
    device: torch.device,
    dtype: torch.dtype,
    reserve_s: float,
    chunk_rows: int = train_peers.CHUNK_ROWS,
) -> list[dict]:
    """The default peer (plans[0]), then the tuned peer's plans while more than reserve_s is left."""
    peers = []
    for k, plan in enumerate(plans):
        record = {"peer": "tuned" if k else "default", **plan.fields()}
        if k and _time_left(args.budget_s) < reserve_s + SECONDS_PER_PEER_PLAN:
            peers.append(dict(record, skipped="time budget"))
            continue
        run = guarded(train_peers.bench_peer, mcfg, plan, args.steps, args.step_tokens, PEAK_TFLOPS, device, dtype, chunk_rows)
        peers.append({**record, **run})
        if "mfu" in run:
            print(
                f"  {label} peer {plan.label()} ({run['loss_kind']}): {run['mfu']:.1%} MFU, "
                f"{run['tokens_per_s'] / 1e3:.1f}k tok/s" + ("" if run["peak_gib"] is None else f", {run['peak_gib']:.1f} GiB"),
                flush=True,
            )
        free_memory()
    return peers


def run_model(name: str, args, info, entry: dict) -> None:
    models = args.models.split(",")
    later = 120 * len(models[models.index(name) + 1 :])  # seconds kept for the models still to run
    reserve = later + (30 if args.profile else 0)
    plans = [int(i) for i in args.plans.split(",")] if args.plans else range(len(GRID[name]))
    peer_plans = [int(i) for i in args.peer_plans.split(",")] if args.peer_plans else range(len(train_peers.GRID[name]))
    peers = entry["peers"] = run_peers(
        name,
        model_config(name),
        [train_peers.DEFAULT, *(train_peers.GRID[name][i] for i in peer_plans)],
        args,
        info.device,
        torch.bfloat16,
        reserve + SECONDS_PER_PLAN * len(plans),
    )
    default = peers[0]
    limit = MEMORY_FRACTION * default["peak_gib"] if "peak_gib" in default and name in MEMORY_TARGET else None
    entry["memory_limit_gib"] = limit
    for k, plan in enumerate(GRID[name][i] for i in plans):
        if k and _time_left(args.budget_s) < reserve + SECONDS_PER_PLAN:
            entry["ours"].append(dict(plan.fields(), skipped="time budget"))
            continue
        out = guarded(bench_ours, name, plan, args.steps, info, limit, args.step_tokens)
        run, trainer = out if isinstance(out, tuple) else (out, None)
        entry["ours"].append(run)
        if "mfu" in run:
            print(
                f"  {name} {plan.label()}: {run['mfu']:.1%} MFU, "
                f"{run['peak_gib']:.1f} GiB, steps {', '.join(f'{t:.3f}' for t in run['step_s'])} s "
                f"(garbage collection {', '.join(f'{t:.3f}' for t in run['gc_s'])} s)"
                + (f" [{run['graph_breaks']} graph breaks]" if run["graph_breaks"] else "")
                + (
                    f" [untimed optimizer state offloads {', '.join(f'{t:.3f}' for t in run['offload_s'])} s]"
                    if run["offload_s"]
                    else ""
                ),
                flush=True,
            )
        if trainer is not None and name == "0.5b" and "offload_pinned" not in entry:
            entry["offload_pinned_reserve_s"] = trainer.memory.reserve()
            entry["offload_pinned"] = guarded(bench_offload, trainer)
            if isinstance(entry["offload_pinned"], list):
                num_bytes = round(entry["offload_pinned"][-1]["gib"] * 2**30)
                entry["pinned_copy"] = guarded(bench_pinned_copy, num_bytes)
        del trainer
        free_memory()
    if name == "0.5b" and _time_left(args.budget_s) > 20 + reserve:
        entry["offload_tms"] = guarded(_tms_offload, name, info)
        free_memory()
    runs = [r for r in entry["ours"] if "mfu" in r]
    best = best_plan(entry) or max(runs, key=lambda r: r["mfu"], default=None)
    if args.profile and best is not None and _time_left(args.budget_s) > 20 + later:
        out = guarded(profile_plan, name, Plan.of(best), info, args.trace, args.step_tokens)
        if isinstance(out, tuple):
            text, entry["profile"] = out
            with PROFILE.open("a") as f:
                f.write(text + "\n\n")
        else:
            entry["profile"] = out
        free_memory()


def _peer(run: dict) -> str:
    if "mfu" not in run:
        return f"FAILED ({run.get('error') or run.get('skipped')})"
    peak = "" if run["peak_gib"] is None else f", {run['peak_gib']:.1f} GiB"
    return (
        f"{run['mfu']:.1%} MFU ({run['mfu_causal']:.1%} causal), {run['tokens_per_s'] / 1e3:.1f}k tok/s{peak} "
        f"({train_peers.PeerPlan.of(run).label()}, {run['micro_batches_per_step']} mb, loss: {run['loss_kind']})"
    )


def _peers_summary(peers: list[dict]) -> str:
    ran = sum("mfu" in p for p in peers)
    return (
        f"default peer {_peer(peers[0])} | best peer of {ran}/{len(peers)} configurations "
        f"{_peer(train_peers.best(peers) or peers[0])}"
    )


def _ratios(ours: dict, peer: dict, which: str) -> str:
    if "mfu" not in peer:
        return ""
    return (
        f" | vs the {which} peer: tok/s ratio {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}, "
        f"memory ratio {ours['peak_gib'] / peer['peak_gib']:.2f}"
    )


def _summary(name: str, entry: dict) -> str:
    peers, best = entry["peers"], best_plan(entry)
    runs = [r for r in entry["ours"] if "mfu" in r]
    best_peer = train_peers.best(peers)
    if not runs or best_peer is None:
        return f"{name}: ours {best or entry['ours']} | peers {peers}"
    note = ""
    if best is None:
        best, note = max(runs, key=lambda r: r["mfu"]), " [no plan fits]"
    line = (
        f"{name}: ours{note} {best['mfu']:.1%} MFU ({best['mfu_causal']:.1%} causal), "
        f"{best['tokens_per_s'] / 1e3:.1f}k tok/s, {best['peak_gib']:.1f} GiB peak "
        f"({Plan.of(best).label()}, {best['num_micro_batches']} mb) | {_peers_summary(peers)}"
        f"{_ratios(best, peers[0], 'default')}{_ratios(best, best_peer, 'best')} | "
        + (
            f"{sum(bool(r['fits']) for r in runs)}/{len(runs)} plans fit {entry['memory_limit_gib']:.1f} GiB"
            if entry.get("memory_limit_gib") is not None
            else "no memory limit"
        )
    )
    for key in ("offload_pinned", "offload_tms"):  # pinned: buffers reserved beforehand (offload_pinned_reserve_s)
        if isinstance(entry.get(key), list):
            last = entry[key][-1]
            line += f" | {key[8:]} offload {last['offload_gb_per_s']:.1f} GB/s, onload {last['onload_gb_per_s']:.1f} GB/s"
    copy = entry.get("pinned_copy")
    if isinstance(copy, dict) and "d2h_gb_per_s" in copy:
        line += f" | one pinned copy of the same bytes {copy['d2h_gb_per_s']:.1f} / {copy['h2d_gb_per_s']:.1f} GB/s"
    if isinstance(entry.get("profile"), dict) and "gpu_idle_fraction" in entry["profile"]:
        line += f" | profiled device idle {entry['profile']['gpu_idle_fraction']:.1%}"
    return line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1.5b,0.5b", help="comma-separated, from: " + ", ".join(SHAPES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--step-tokens", type=int, default=STEP_TOKENS, help="tokens of one optimizer step, for ours and the peers"
    )
    parser.add_argument("--profile", action="store_true", help="profile each model's best plan")
    parser.add_argument("--trace", default=None, help="directory for gzipped chrome traces of the profiles")
    parser.add_argument("--plans", default=None, help="comma-separated indices into each model's GRID (default all)")
    parser.add_argument(
        "--peer-plans",
        default=None,
        help="comma-separated indices into each model's tuned peer grid (train_peers.GRID; default all)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="wall-clock budget: optional plans are skipped when it runs short"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="the peers only, on a tiny shape in fp32 on CPU")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default bench/results/train.json)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        return _cpu_smoke(args)
    for name in args.models.split(","):
        if name not in SHAPES:
            raise ValueError(f"--models: unknown model {name!r}; known: {', '.join(SHAPES)}")
    info = dist.init()
    torch.manual_seed(0)
    probe = torch.empty(1, 1, 128, device="cuda", dtype=torch.bfloat16)
    attention = "flash-attn-4" if flash.usable(probe) else "torch varlen (flash-attn 2)"
    print(f"our attention kernel: {attention}", flush=True)
    results = {
        **machine(),
        "peak_tflops": PEAK_TFLOPS,
        "attention": attention,
        "torchtitan": f"not run: {train_peers.TORCHTITAN}",
        "models": {},
    }
    out = args.out or RESULTS
    if out.exists():  # a run over some models keeps the other models' last entries
        results["models"] = json.loads(out.read_text()).get("models", {})
    if args.profile:
        PROFILE.write_text("")
    for name in args.models.split(","):
        entry = results["models"][name] = {"params": num_params(model_config(name)), "step_tokens": args.step_tokens, "ours": []}
        run_model(name, args, info, entry)
        entry["elapsed_s"] = time.monotonic() - START
        print(_summary(name, entry), flush=True)
        write_result(results, out)  # after each model: a cut-short run keeps its data
    dist.destroy()


def _cpu_smoke(args) -> None:
    """The default and tuned peers' code on a tiny shape in fp32 on CPU (ours needs CUDA): one
    step each of 512 tokens; the JSON lists every configuration, the line the default and the best."""
    dist.init(backend="gloo")
    args.steps, args.step_tokens = 1, 512
    peers = run_peers(
        "tiny",
        train_peers.SMOKE_SHAPE,
        [train_peers.SMOKE_DEFAULT, *train_peers.SMOKE_GRID],
        args,
        torch.device("cpu"),
        torch.float32,
        reserve_s=0.0,
        chunk_rows=train_peers.SMOKE_CHUNK_ROWS,
    )
    dist.destroy()
    out = result_path(args.out, RESULTS, smoke=True)
    write_result(
        {
            **machine(torch.device("cpu")),
            "torchtitan": f"not run: {train_peers.TORCHTITAN}",
            "models": {"tiny": {"step_tokens": args.step_tokens, "peers": peers}},
        },
        out,
    )
    print(f"tiny (cpu): {_peers_summary(peers)}", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
