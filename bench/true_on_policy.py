"""The cost of algorithm.true_on_policy (batch-invariant numerics, colocate/kernels/batch_invariant.py)
on one GPU: rollout and trainer throughput with the mode off and on, in one run, and whether the
engine's log-probs equal the trainer's bit for bit with it on.

Per shape (bench/train_plans.py's Qwen2.5-0.5B / -1.5B shapes, random bf16 weights):
- rollout: the native engine on bench/rollout_throughput.py's b256 case (256 prompts x 128 tokens in, 256 out,
  temperature 1, ignore_eos). Off: its default GPU settings (CUDA graphs, compiled decode), as
  bench/rollout_throughput.py builds it; on: the mode's table (Ops.true_on_policy) handed to the model, decode
  uncompiled, CUDA graphs on. One warm-up generate, then the median output tok/s of --reps.
- bitwise_equal_frac: of the mode-on warm-up generate's sampled tokens, the fraction whose engine
  log-prob equals the trainer's forward's (fp32, bit for bit), as tests/parity/test_true_on_policy_gpu.py
  compares them.
- train: optimizer steps of --step-tokens tokens (prompt + response, bench/trainer_throughput.py's steps on its
  rollout-like samples), one plan per shape (the best of bench/results/train.json, else the grid's
  first; the optimizer state stays resident; --max-tokens-per-gpu overrides its micro-batch, for a
  GPU with less memory than the one train.json was measured on): off and on, each compiled (the
  default, through the mode's custom ops when on: colocate/kernels/invariant_ops.py) and
  uncompiled. Median tok/s of --reps steps after 2 warm-up steps. The training cases run before the
  rollout ones: an engine's CUDA-graph pools stay reserved in its process after shutdown.
Slowdowns are off / on tok/s; targets: rollout <= 1.3, train <= 1.15 (both compiled).

Run: python -m bench.true_on_policy [--models 0.5b,1.5b] [--reps 3] [--step-tokens 131072] [--out PATH]
                                    [--max-tokens-per-gpu N] [--profile PATH]   (op tables of every case)
     python -m bench.true_on_policy --cpu-smoke [--out PATH]   (a tiny shape in fp32 on CPU)
Each shape runs in a process of its own (an engine's CUDA-graph and memory-saver pools stay reserved in
its process after shutdown). Writes bench/results/true_on_policy.json (after each shape); prints one
summary line per shape.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import random
import statistics
import subprocess
import time

import torch

from bench.common import (
    RESULTS_DIR,
    child_env,
    free_memory,
    guarded,
    machine,
    module_command,
    result_path,
    sync,
    write_result,
)
from bench.rollout_throughput import CASES, make_prompts, timed_generate
from bench.train_peers import SMOKE_SHAPE
from bench.train_plans import GRID, SHAPES, STEP_TOKENS, Plan, best_plan, make_samples, model_config, trainer_config
from bench.trainer_throughput import RESULTS as TRAIN_RESULTS
from colocate import dist
from colocate.kernels import batch_invariant
from colocate.kernels.ops import Ops
from colocate.models import from_config
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import SamplingParams
from colocate.rollout.sample import Sample
from colocate.trainer import Trainer
from colocate.trainer.actor import response_logprobs
from colocate.trainer.batch import RolloutBatch, build_micro_batch
from colocate.trainer.packing import pack_micro_batches
from colocate.trainer.parallelize import ActivationCheckpointing

MODULE = "bench.true_on_policy"  # each shape's process runs it
RESULTS = RESULTS_DIR / "true_on_policy.json"
TARGETS = {"rollout_slowdown": 1.3, "train_slowdown": 1.15}
WARMUP_STEPS = 2
LOGPROB_TOKENS = 8192
"""Micro-batch token budget of the trainer forward that the engine's log-probs are compared with."""
ROLLOUT = dict(zip(("prompts", "n", "prompt_tokens", "new_tokens"), CASES["b256"]))
SMOKE_ROLLOUT = dict(prompts=8, n=1, prompt_tokens=16, new_tokens=8)
SMOKE_STEP_TOKENS, SMOKE_RESPONSE_TOKENS = 16384, 16
"""--cpu-smoke: a step's samples drawn for this many tokens, then each response cut to 16 tokens
(the mode's CPU attention is slow on long sequences)."""


@contextlib.contextmanager
def mode(on: bool, device: torch.device):
    """The table of operations to compute with inside the block: the mode's when `on` (its aten
    kernels switched on), else the standard one; aten's own kernels after it."""
    batch_invariant.disable()
    try:
        yield Ops.true_on_policy(device) if on else Ops.standard()
    finally:
        batch_invariant.disable()


def pick_plan(name: str) -> tuple[Plan, str]:
    """The fastest plan within the memory limit of the last bench/trainer_throughput.py run of `name`, else the
    grid's first; either way without optimizer-state offload between steps."""
    try:
        best = best_plan(json.loads(TRAIN_RESULTS.read_text())["models"][name])
    except (OSError, ValueError, KeyError):
        best = None
    if best is None:
        return GRID[name][0], "first plan of bench/train_plans.py GRID"
    return Plan.of(best)._replace(offload=False), "best plan of bench/results/train.json"


def bitwise_equal_frac(model, prompts: list[list[int]], outs, device: torch.device) -> float:
    """Fraction of the sampled tokens whose engine log-prob equals the trainer's forward's."""
    samples = [
        Sample(prompts[c.prompt_index], c.output_ids, c.logprobs, [1] * len(c.output_ids), c.prompt_index, c.sample_index)
        for c in outs
    ]
    engine = torch.tensor([lp for c in outs for lp in c.logprobs], dtype=torch.float32)
    batch = RolloutBatch.from_samples(samples, device)
    trainer = torch.zeros(batch.mask.shape, dtype=torch.float32, device=device)
    for part in pack_micro_batches(batch.lengths, LOGPROB_TOKENS):
        mb = build_micro_batch(batch, part, device)
        with torch.no_grad():
            trainer[mb.token_index] = response_logprobs(model, mb, 1.0)[0]
    return (trainer.cpu() == engine).float().mean().item()


def kernel_table(fn, device: torch.device, label: str, tables: list[str] | None) -> None:
    """With `tables` (--profile), run fn once more under torch.profiler and append its op table."""
    if tables is None:
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        sync(device)
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    tables.append(f"== {label}\n" + prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=90))


def run_rollout(
    mcfg, on: bool, run: dict, reps: int, device: torch.device, dtype: torch.dtype, tables: list[str] | None = None
) -> dict:
    prompts = make_prompts(run["prompts"], run["prompt_tokens"], vocab_size=mcfg.vocab_size)
    sp = SamplingParams(temperature=1.0, max_new_tokens=run["new_tokens"], ignore_eos=True, seed=0)
    sampling = [sp] * len(prompts)  # as bench/rollout_throughput.py's run_ours
    cuda = device.type == "cuda"
    with mode(on, device) as ops:
        torch.manual_seed(0)
        model = from_config(mcfg, dtype, device, init=True).eval()
        model.set_ops(ops)
        engine = NativeEngine(
            model,
            device=device,
            max_kv_tokens=1 << 20 if cuda else 4096,
            max_num_seqs=len(prompts),
            cuda_graph=True,
            compile_decode=cuda and not on,
            ops=ops,
        )
        outs = engine.generate(prompts, sampling)  # warm-up
        runs = [timed_generate(engine, prompts, sampling) for _ in range(reps)]
        kernel_table(
            functools.partial(engine.generate, prompts, sampling), device, f"generate, mode {'on' if on else 'off'}", tables
        )
        result = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "ms_per_decode_step": statistics.median(r["ms_per_decode_step"] for r in runs),
            "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
            "compile_decode": cuda and not on,
            "cuda_graphs": engine.runner.graphs is not None,
        }
        engine.shutdown()
        del engine
        if on:
            result["bitwise_equal_frac"] = bitwise_equal_frac(model, prompts, outs, device)
        del model, outs
    free_memory()
    return result


def run_train(
    mcfg, plan: Plan, on: bool, compiled: bool, info, batches: list[list[Sample]], tables: list[str] | None = None
) -> dict:
    device = info.device
    with mode(on, device) as ops:
        cfg = trainer_config(len(batches[0]), plan, "pinned", compiled)
        cfg.algorithm.true_on_policy = on
        trainer = Trainer(
            cfg,
            info,
            ops=ops,
            model_config=mcfg,
            checkpointing=ActivationCheckpointing(plan.full, plan.rest, plan.keep_attention),
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for batch in batches:
            sync(device)
            start = time.perf_counter()
            trainer.train(batch, 1)
            sync(device)
            times.append(time.perf_counter() - start)
        kernel_table(
            functools.partial(trainer.train, batches[-1], 1),
            device,
            f"train step, mode {'on' if on else 'off'}, {'compiled' if compiled else 'uncompiled'}",
            tables,
        )
        del trainer
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    free_memory()
    tokens = [sum(len(s.tokens) for s in b) for b in batches[WARMUP_STEPS:]]
    return {
        "compile": compiled,
        "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times[WARMUP_STEPS:])),
        "step_s": times[WARMUP_STEPS:],
        "warmup_s": sum(times[:WARMUP_STEPS]),
        "step_tokens": tokens,
        "peak_gib": peak,
    }


def train_batches(vocab: int, step_tokens: int, reps: int, smoke: bool) -> list[list[Sample]]:
    rng = random.Random(0)
    batches = [make_samples(rng, vocab, step_tokens) for _ in range(WARMUP_STEPS + reps)]
    if smoke:
        n = SMOKE_RESPONSE_TOKENS
        batches = [
            [
                Sample(
                    s.prompt_ids,
                    s.response_ids[:n],
                    s.rollout_logprobs[:n],
                    s.loss_mask[:n],
                    s.group_index,
                    s.sample_index,
                    reward=s.reward,
                )
                for s in b
            ]
            for b in batches
        ]
    return batches


def run_shape(name: str, mcfg, plan: Plan, source: str, args, info) -> dict:
    device, smoke = info.device, args.cpu_smoke
    dtype = torch.float32 if smoke else torch.bfloat16
    run = SMOKE_ROLLOUT if smoke else ROLLOUT
    tables = [] if args.profile else None
    batches = train_batches(mcfg.vocab_size, args.step_tokens, args.reps, smoke)
    cases = {
        "off": (False, not smoke),
        "off_uncompiled": (False, False),
        "on": (True, not smoke),
        "on_uncompiled": (True, False),
    }  # a case that fails (out of memory, say) is recorded, not fatal
    train = {case: guarded(run_train, mcfg, plan, on, compiled, info, batches, tables) for case, (on, compiled) in cases.items()}
    off = run_rollout(mcfg, False, run, args.reps, device, dtype, tables)
    on = run_rollout(mcfg, True, run, args.reps, device, dtype, tables)
    if tables is not None:
        path = args.profile.with_name(f"{args.profile.stem}.{name}{args.profile.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(tables) + "\n")
        print(f"profile -> {path}", flush=True)
    rollout_slowdown = off["tokens_per_s"] / on["tokens_per_s"]
    train_slowdown = _slowdown(train["off"], train["on"])
    return {
        "rollout_case": run,
        "plan": {**plan.fields(), "label": plan.label(), "source": source},
        "rollout": {"off": off, "on": on, "slowdown": rollout_slowdown},
        "train": {
            **train,
            "slowdown": train_slowdown,
            "slowdown_uncompiled": _slowdown(train["off_uncompiled"], train["on_uncompiled"]),
        },
        "bitwise_equal_frac": on.pop("bitwise_equal_frac"),
        "targets": TARGETS,
        "met": {
            "rollout": rollout_slowdown <= TARGETS["rollout_slowdown"],
            "train": train_slowdown is not None and train_slowdown <= TARGETS["train_slowdown"],
        },
    }


def _slowdown(off: dict, on: dict) -> float | None:
    """Tokens per second off over on; None where either case failed."""
    return off["tokens_per_s"] / on["tokens_per_s"] if "tokens_per_s" in off and "tokens_per_s" in on else None


def summary(name: str, r: dict) -> str:
    ro, tr = r["rollout"], r["train"]
    k = lambda run: f"{run['tokens_per_s'] / 1e3:.1f}k" if "tokens_per_s" in run else "failed"  # noqa: E731
    x = lambda ratio: "n/a" if ratio is None else f"{ratio:.2f}x"  # noqa: E731
    ok = lambda met: "met" if met else "MISSED"  # noqa: E731
    failed = "".join(f"; {case} failed: {run['error']}" for case, run in tr.items() if isinstance(run, dict) and "error" in run)
    return (
        f"{name}: rollout {k(ro['off'])} -> {k(ro['on'])} tok/s, {ro['slowdown']:.2f}x slower "
        f"(target <= {TARGETS['rollout_slowdown']}: {ok(r['met']['rollout'])}); train {k(tr['off'])} -> "
        f"{k(tr['on'])} tok/s, {x(tr['slowdown'])} slower (target <= {TARGETS['train_slowdown']}: "
        f"{ok(r['met']['train'])}; uncompiled {k(tr['off_uncompiled'])} -> {k(tr['on_uncompiled'])}, "
        f"{x(tr['slowdown_uncompiled'])}); bitwise equal log-probs {r['bitwise_equal_frac']:.2%} of tokens" + failed
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.true_on_policy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="0.5b,1.5b", help="comma-separated, from: " + ", ".join(SHAPES))
    parser.add_argument("--reps", type=int, default=3, help="timed generates and timed train steps per case")
    parser.add_argument("--step-tokens", type=int, default=STEP_TOKENS, help="tokens of one optimizer step")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="JSON path (default bench/results/true_on_policy.json; a temporary one with --cpu-smoke)",
    )
    parser.add_argument(
        "--max-tokens-per-gpu", type=int, default=None, help="the trainer plan's micro-batch tokens instead of the picked plan's"
    )
    parser.add_argument(
        "--profile",
        type=pathlib.Path,
        default=None,
        help="op tables of one more generate and train step per case, to PATH's stem.<shape>.txt",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape in fp32 on CPU, nothing compiled")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.step_tokens = SMOKE_STEP_TOKENS
        shapes = {"tiny": (SMOKE_SHAPE, GRID["0.5b"][0], "first plan of the 0.5b grid (smoke)")}
        out = result_path(args.out, RESULTS, smoke=True)
    else:
        unknown = [m for m in args.models.split(",") if m not in SHAPES]
        if unknown:
            raise ValueError(f"--models: unknown {unknown}; known: {', '.join(SHAPES)}")
        shapes = {m: (model_config(m), *pick_plan(m)) for m in args.models.split(",")}
        out = args.out or RESULTS
    if args.max_tokens_per_gpu is not None:
        shapes = {
            name: (mcfg, plan._replace(max_tokens=args.max_tokens_per_gpu), f"{source}, micro-batch overridden")
            for name, (mcfg, plan, source) in shapes.items()
        }
    if len(shapes) > 1:  # one process per shape: a shut-down engine's pools stay reserved in its process
        run_each(list(shapes), args, out)
        return
    info = dist.init()
    results = {**machine(info.device), "reps": args.reps, "step_tokens": args.step_tokens, "models": {}}
    for name, (mcfg, plan, source) in shapes.items():
        results["models"][name] = run_shape(name, mcfg, plan, source, args, info)
        write_result(results, out)
        print(summary(name, results["models"][name]), flush=True)
    dist.destroy()
    print(f"wrote {out}")


def run_each(names: list[str], args, out: pathlib.Path) -> None:
    """This bench for each shape in a process of its own, the results merged into `out` after each."""
    results = None
    for name in names:
        part = out.with_name(f"{out.stem}.{name}.json")
        cmd = module_command(
            MODULE, "--models", name, "--reps", str(args.reps), "--step-tokens", str(args.step_tokens), "--out", str(part)
        )
        if args.max_tokens_per_gpu is not None:
            cmd += ["--max-tokens-per-gpu", str(args.max_tokens_per_gpu)]
        if args.profile:
            cmd += ["--profile", str(args.profile)]
        if subprocess.run(cmd, env=child_env()).returncode != 0:
            raise SystemExit(f"{name}: the bench failed (its output is above)")
        done = json.loads(part.read_text())
        part.unlink()
        results = done if results is None else {**results, "models": {**results["models"], **done["models"]}}
        write_result(results, out)  # a cut-short run keeps its data
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
