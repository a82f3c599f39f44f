"""Colocation hand-offs on one GPU, each beside the plain device operation that bounds it.

- Weight sync: `sync_weights` from the FSDP2 trainer (fp32 master shards, gathered in bf16 one unit
  at a time) into the native engine, Qwen2.5-1.5B shape, against one device-to-device copy of the
  same number of bf16 bytes. Target: at most 2x the copy.
- Engine release / resume: `release_memory` then `resume_memory` of weights, KV cache (about
  14 GiB) and CUDA graphs, host wall time with the device synchronised. Target: 50 ms together.
  The resume again, by what came just before it: 300 ms of rest after the release, or a train
  phase's worth of memory (what the release freed, in 512 MiB activations) allocated and handed
  back to the driver right before it, as the loop's `to_rollout` does.

Medians over --rounds. The process re-executes itself with torch_memory_saver's preload hook (as
launch.sh runs the loop), so that graph memory is pausable too.
Run: python -m bench.colocation [--rounds 5]; writes bench/results/colocation.json.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import torch

from bench.common import RESULTS_DIR, child_env, machine, module_command, timed, write_result
from bench.train_plans import model_config
from colocate import dist
from colocate.colocation.weight_sync import sync_weights
from colocate.config import Config
from colocate.memory_saver import preload_active, preload_library, with_preload
from colocate.models import CausalLM
from colocate.rollout.native import NativeEngine
from colocate.trainer import Trainer

MODULE = "bench.colocation"  # re-executed with the preload hook
RESULTS = RESULTS_DIR / "colocation.json"
TAGS = ["weights", "kv_cache", "cuda_graph"]


def copy_ms(num_bytes: int, rounds: int) -> float:
    """Median device time of one bf16 device-to-device copy of num_bytes."""
    src = torch.randn(num_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for _ in range(rounds + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def _train_phase_memory(num_bytes: int) -> None:
    """Allocate about `num_bytes` in 512 MiB activations, write them, and hand them back to the
    driver, as a train phase between the engine's release and its resume does."""
    block = 512 << 20
    held = [torch.empty(block, dtype=torch.uint8, device="cuda") for _ in range(max(1, int(0.9 * num_bytes) // block))]
    for t in held:
        t.fill_(1)
    torch.cuda.synchronize()
    del held
    torch.cuda.empty_cache()


def _mismatched(policy: torch.nn.Module, engine: NativeEngine) -> list[str]:
    """Engine parameters that differ from the trainer's masters cast to the engine dtype."""
    engine_params = dict(engine.model.named_parameters())
    bad = []
    for name, p in policy.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if name in engine_params and not torch.equal(full.to(engine_params[name].dtype), engine_params[name]):
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.colocation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1.5b", help="model shape from bench/train_plans.py")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-tokens", type=int, default=1 << 19, help="engine KV-cache capacity")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.colocation needs a CUDA device")
    if preload_library() and not preload_active():
        os.execve(sys.executable, module_command(MODULE, *sys.argv[1:]), child_env(env=with_preload(os.environ)))

    info = dist.init()
    mcfg = model_config(args.model)
    cfg = Config()
    cfg.train.num_rollout = 10
    trainer = Trainer(cfg, info, model_config=mcfg)
    policy = trainer.actor_module
    with torch.device("cuda"):
        source = CausalLM(mcfg).to(torch.bfloat16)
    engine = NativeEngine(
        source, device=info.device, max_kv_tokens=args.kv_tokens, max_num_seqs=32, cuda_graph_max_bs=32, compile_decode=False
    )
    del source
    torch.cuda.empty_cache()

    syncs = []
    for version in range(1, args.rounds + 2):
        syncs.append(
            sync_weights(
                policy, engine, version=version, dtype=torch.bfloat16, bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20
            )
        )
    mismatched = _mismatched(policy, engine)
    if mismatched:
        raise SystemExit(f"weight sync left {len(mismatched)} engine tensors unequal to the masters: {mismatched[:3]}")
    sync_bytes = syncs[-1].num_bytes
    sync_ms = statistics.median(1e3 * s.seconds for s in syncs[1:])
    copy = copy_ms(sync_bytes, args.rounds)

    memory = engine.memory_stats()
    release, resume, freed = [], [], []
    for _ in range(args.rounds):
        before = torch.cuda.mem_get_info()[0]
        release.append(1e3 * timed(lambda: engine.release_memory(TAGS)))
        freed.append(torch.cuda.mem_get_info()[0] - before)
        resume.append(1e3 * timed(lambda: engine.resume_memory(TAGS)))
    rested, after_free = [], []
    for _ in range(args.rounds):
        engine.release_memory(TAGS)
        time.sleep(0.3)
        rested.append(1e3 * timed(lambda: engine.resume_memory(TAGS)))
        engine.release_memory(TAGS)
        _train_phase_memory(statistics.median(freed))
        after_free.append(1e3 * timed(lambda: engine.resume_memory(TAGS)))
    engine.shutdown()

    results = {
        **machine(),
        "model": args.model,
        "weight_sync": {
            "bytes": sync_bytes,
            "tensors": syncs[-1].num_tensors,
            "buckets": syncs[-1].num_buckets,
            "ms": sync_ms,
            "all_ms": [1e3 * s.seconds for s in syncs],
            "d2d_copy_ms": copy,
            "ratio_to_copy": sync_ms / copy,
        },
        "engine_memory": memory,
        "release_resume": {
            "release_ms": statistics.median(release),
            "resume_ms": statistics.median(resume),
            "total_ms": statistics.median(a + b for a, b in zip(release, resume)),
            "freed_gib": statistics.median(freed) / 2**30,
            "resume_rested_ms": statistics.median(rested),
            "rested_all_ms": rested,
            "resume_after_train_memory_ms": statistics.median(after_free),
            "after_train_memory_all_ms": after_free,
        },
    }
    write_result(results, args.out)
    w, r = results["weight_sync"], results["release_resume"]
    print(
        f"colocation ({args.model}, {results['device']}): weight sync {w['bytes'] / 2**30:.2f} GiB in "
        f"{w['ms']:.1f} ms = {w['ratio_to_copy']:.2f}x a device copy ({w['d2d_copy_ms']:.2f} ms) | release "
        f"{r['release_ms']:.1f} ms + resume {r['resume_ms']:.1f} ms, {r['freed_gib']:.1f} GiB freed "
        f"({memory['mode']}); resume rested {r['resume_rested_ms']:.1f} ms, right after a train phase's "
        f"memory {r['resume_after_train_memory_ms']:.1f} ms -> {args.out}"
    )


if __name__ == "__main__":
    main()
