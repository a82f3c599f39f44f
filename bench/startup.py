"""Start-up time, cold and warm: the 1-GPU smoke run and offline generation, each a fresh process.

    python -m bench.startup [--cases toy,generate,generate_compiled,rollout_engine] [--out PATH] [--cpu-smoke]
    python -m bench.startup --cases pinning,qwen3_4b --out bench/results/startup_4b.json

Cases:
  toy       `python -m colocate.train` on configs/default.yaml for 10 steps (`./launch.sh test-gpu`'s
            loop): wall time, the `perf/startup/*` phases it logs, and the steps after start-up.
  generate  `python -m colocate.generate` on a Qwen2.5-0.5B shape (random bf16 weights), 256 prompts
            of 128 token ids x 256 new tokens (ignore_eos): wall time and its start-up line. Its
            default --compile-decode auto leaves this short job's decode uncompiled;
  generate_compiled  the same with --compile-decode on, for the compile's cost beside it.
  rollout_engine  `python -m bench.rollout_throughput --cases b256 --peers none`: the engine of
            its rollout figures (0.5B shape, decode compiled, CUDA graphs up to 256): its init time
            and parts, wall time, and b256 tok/s (start-up must not cost steady-state speed). With
            --cpu-smoke its tail case on a tiny shape instead.
Cases run only when named:
  qwen3_4b  `python -m colocate.train` on a Qwen3-4B shape (random bf16 weights, bench/e2e.py's "4b"),
            full fine-tuning with offload on, 32 prompts x 8 samples (the decode graphs of the
            measured 4B run) of 32 new tokens, one step: the start-up phases and their parts (the
            inputs' imports, tokenizer and data; the trainer's pinned buffers, their layouts; the
            engine's first decode, the compile or the cache's hit), and the first record's moves of
            the trainer's state (`moves`): the start-up offload's bytes copied, of them to pageable
            memory (pieces not pinned yet), left behind as zeros (a fresh optimizer's state), its
            wait for pinning (none by design); the first sync's (`first_sync/*`: its second offload
            of the parameters waits for their pinned pieces); the host buffers pinned by the end of
            start-up; and step 0's moves, where any pinning still left is waited for. With
            --cpu-smoke a tiny shape on CPU (offload off).
  pinning   pinning 8 GiB of host memory in 1 GiB pieces with 1, 2, 4 and 8 helper threads, each in
            a fresh process, with cudaHostAlloc (`alloc`, torch's default) and by registering pages
            faulted in first (`register`, what the offload uses): GB/s, and the calling thread's
            stalls meanwhile (a tiny kernel and a wait for it, in a loop: the longest, and the share
            of the time spent in them), which is what pinning costs a start-up that goes on beside
            it. CUDA only.

Each case runs twice in a set of empty cache directories of its own (Triton, inductor, colocate's
toy model and data): "cold" is the first run, as on a fresh CI machine, "warm" the second, caches
filled. (Shared, a case would find the kernels and graphs that an earlier case compiled, such as
generate_compiled's decode layer, which rollout_engine's is too.) Writes bench/results/startup.json
(the device's name inside). --cpu-smoke: generate, rollout_engine and qwen3_4b on a tiny shape (CPU,
for tests).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

from bench import e2e
from bench.common import RESULTS_DIR, ROOT, child_env, machine, module_command, write_result
from bench.rollout_throughput import HF_CONFIG, make_prompts
from colocate.metrics import read_metrics, split_startup, startup_phases

RESULTS = RESULTS_DIR / "startup.json"
TOY_STEPS = 10
GENERATE = dict(prompts=256, prompt_tokens=128, new_tokens=256)
SMOKE_GENERATE = dict(prompts=8, prompt_tokens=16, new_tokens=8)
SMOKE_SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
CASES = ("toy", "generate", "generate_compiled", "rollout_engine")
NAMED_CASES = ("qwen3_4b", "pinning")
"""Cases that run only when --cases names them (minutes of GPU time, tens of GB of host memory)."""
BATCH_4B = dict(prompts=32, samples_per_prompt=8, response_tokens=32)
SMOKE_BATCH_4B = dict(prompts=4, samples_per_prompt=4, response_tokens=8)
RUN_4B_TIMEOUT_S = 420
"""Per run of the 4B case: a cold start measured 78 s, and its one step takes seconds."""
PIN_GIB = 8
PIN_THREADS = (1, 2, 4, 8)
PIN_MODES = ("alloc", "register")
PIN_CODE = """
import sys, time
import torch
from colocate.trainer.host_buffers import HostPieces, pin_in_background, use_registered_pinning

num_gib, num_threads, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
device = torch.device("cuda", 0)
probe = torch.zeros(1, device=device)  # the context, before the clock starts
if mode == "register":
    use_registered_pinning()
pieces = HostPieces([1 << 30] * num_gib)
start = time.perf_counter()
threads = pin_in_background([pieces], device, num_threads=num_threads)
stalls = []
while any(thread.is_alive() for thread in threads):
    begin = time.perf_counter()
    probe.add_(1)
    torch.cuda.synchronize()
    stalls.append(time.perf_counter() - begin)
    time.sleep(0.001)
for thread in threads:
    thread.join()
seconds = time.perf_counter() - start
assert all(pieces.get(i).is_pinned() for i in range(num_gib))
print(seconds, max(stalls, default=0.0), sum(stalls))
"""


def cache_env(root: pathlib.Path) -> dict:
    """An environment whose compile caches and colocate cache live under `root`."""
    env = dict(os.environ)
    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("COLOCATE_CACHE", "colocate")):
        env[var] = str(root / sub)
    return env


def timed_run(cmd: list[str], env: dict, log: pathlib.Path, timeout: float = 550) -> float:
    start = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:4])} failed (rc {done.returncode}); last lines:\n" + "\n".join(log.read_text().splitlines()[-15:])
        )
    return seconds


def memory_saver_preload(config: pathlib.Path, env: dict) -> dict:
    """The LD_PRELOAD that launch.sh sets on a GPU machine (the engine's pausable CUDA graphs)."""
    out = subprocess.run(module_command("colocate.memory_saver", str(config)), env=env, cwd=ROOT, capture_output=True, text=True)
    preload = out.stdout.strip()
    return {**env, "LD_PRELOAD": preload} if out.returncode == 0 and preload else env


def run_toy(work: pathlib.Path, env: dict, label: str) -> dict:
    return run_loop(work, env, f"toy_{label}", ROOT / "configs" / "default.yaml", TOY_STEPS)


def run_loop(work: pathlib.Path, env: dict, name: str, config: pathlib.Path, steps: int, timeout: float = 550) -> dict:
    """`python -m colocate.train` on this config for `steps` steps: wall time, start-up phases."""
    out_dir = work / name
    cmd = module_command(
        "colocate.train",
        "--config",
        str(config),
        "--output-dir",
        str(out_dir),
        "--train.num_rollout",
        str(steps),
        "--logging.console",
        "False",
    )
    env = memory_saver_preload(config, env)  # before the clock starts: it runs a process of its own
    start = time.time()
    wall = timed_run(cmd, env, work / f"{name}.log", timeout)
    end = time.time()  # the records' clock: `wall` is monotonic, and the wall clock may be slewed against it
    rows = read_metrics(out_dir)
    if not rows:
        raise RuntimeError(f"{name}: no step was logged under {out_dir}")
    startup = startup_phases(rows[0])
    moves = {k.removeprefix("handoff/"): v for k, v in rows[0].items() if k.startswith("handoff/")}
    top = sum(split_startup(startup)[0].values())
    first_done = rows[0]["time"] - start
    # What the logged phases leave out: before step 0, the process's spawn and what its phases do
    # not cover (where /proc is missing, the interpreter and imports too); after the last step, the
    # engine's shutdown, the process group's teardown and the exit.
    outside = {"before_startup": first_done - top - rows[0]["perf/step_time"], "after_last_step": end - rows[-1]["time"]}
    return {
        "wall_s": wall,
        "startup_s": top,
        "phases_s": startup,
        "moves": moves,
        "outside_s": outside,
        "first_step_done_s": first_done,
        "steps_s": rows[-1]["time"] - rows[0]["time"],
        "steps": len(rows),
    }


def write_4b_inputs(work: pathlib.Path, smoke: bool) -> pathlib.Path:
    """bench/e2e.py's random-weight model (its "4b" shape, or "tiny" for the smoke) with its byte
    tokenizer, prompts, and a config for one step of full fine-tuning with offload on."""
    import yaml

    shape, batch = ("tiny", SMOKE_BATCH_4B) if smoke else ("4b", BATCH_4B)
    model_dir, prompts = e2e.write_inputs(work / "qwen3_4b_inputs", shape, batch["prompts"])
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the weights were drawn on the GPU: the runs need that memory
    cfg = e2e.ours_config(work, model_dir, prompts, shape, "qwen3_4b", offload=not smoke, compile=False, budget=None, num_steps=1)
    cfg["rollout"].update(
        rollout_batch_size=batch["prompts"],
        n_samples_per_prompt=batch["samples_per_prompt"],
        max_response_len=batch["response_tokens"],
    )
    cfg["model"]["gradient_checkpointing"] = not smoke
    config = work / "qwen3_4b.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def run_4b(work: pathlib.Path, env: dict, label: str, config: pathlib.Path) -> dict:
    # The config's hooks (reward, fixed-length generation) live in bench/e2e.py.
    return run_loop(work, child_env(env=env), f"qwen3_4b_{label}", config, 1, RUN_4B_TIMEOUT_S)


def run_pinning() -> dict:
    """Per way of pinning and number of helper threads: seconds and GB/s to pin PIN_GIB GiB in
    1 GiB pieces, and the calling thread's longest stall and share of time stalled meanwhile."""
    out = {}
    for mode in PIN_MODES:
        out[mode] = {}
        for threads in PIN_THREADS:
            done = subprocess.run(
                [sys.executable, "-c", PIN_CODE, str(PIN_GIB), str(threads), mode],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                raise RuntimeError(f"pinning ({mode}, {threads} threads) failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
            seconds, longest, stalled = (float(x) for x in done.stdout.split()[-3:])
            out[mode][f"threads_{threads}"] = {
                "seconds": seconds,
                "gb_per_s": PIN_GIB * (1 << 30) / seconds / 1e9,
                "longest_stall_s": longest,
                "stalled_share": stalled / seconds,
            }
            print(
                f"pinning {PIN_GIB} GiB ({mode}), {threads} threads -> {seconds:.2f} s; the calling thread stalled "
                f"up to {longest:.3f} s, {stalled / seconds:.0%} of the time",
                flush=True,
            )
    return out


def write_generate_inputs(work: pathlib.Path, smoke: bool) -> tuple[pathlib.Path, pathlib.Path]:
    """A random bf16 model directory (no tokenizer) and a JSONL of token-id prompts."""
    from colocate.models import ArchConfig, from_config, save_pretrained

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = {**HF_CONFIG, "model_type": "qwen2", **(SMOKE_SHAPE if smoke else {})}
    model = from_config(ArchConfig.from_hf_dict(shape), torch.bfloat16, device, init=True)
    model_dir = save_pretrained(model, work / "model")
    del model
    prompts = work / "prompts.jsonl"
    sizes = SMOKE_GENERATE if smoke else GENERATE
    ids = make_prompts(sizes["prompts"], sizes["prompt_tokens"], vocab_size=shape["vocab_size"])
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in ids))
    return model_dir, prompts


def run_generate(work: pathlib.Path, env: dict, label: str, inputs, new_tokens: int, compile_decode: str) -> dict:
    model_dir, prompts = inputs
    cmd = module_command(
        "colocate.generate",
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(work / f"generate_{label}.jsonl"),
        "--max-new-tokens",
        str(new_tokens),
        "--ignore-eos",
        "--compile-decode",
        compile_decode,
    )
    log = work / f"generate_{label}.log"
    wall = timed_run(cmd, env, log)
    rows = [json.loads(line) for line in (work / f"generate_{label}.jsonl").read_text().splitlines()]
    num_prompts = sum(1 for _ in prompts.open())
    if len(rows) != num_prompts or any(len(r["output_ids"]) != new_tokens for r in rows):
        raise RuntimeError(f"generate wrote {len(rows)} rows for {num_prompts} prompts, or short outputs")
    line = next((x for x in log.read_text().splitlines() if x.startswith("start-up ")), None)
    return {"wall_s": wall, "output_tokens": float(len(rows) * new_tokens), "startup_line": line}


def run_rollout_engine(work: pathlib.Path, env: dict, label: str, smoke: bool) -> dict:
    out = work / f"rollout_{label}.json"
    cases = ["--cases", "tail", "--cpu-smoke"] if smoke else ["--cases", "b256", "--peers", "none"]
    cmd = module_command("bench.rollout_throughput", *cases, "--out", str(out))
    wall = timed_run(cmd, child_env(env=env), work / f"rollout_{label}.log")
    r = json.loads(out.read_text())
    speed = r["tail"] if smoke else r["cases"]["b256"]["ours"]
    return {
        "wall_s": wall,
        "init_s": r["engine"]["init_seconds"],
        "init_parts_s": r["engine"]["init_parts_seconds"],
        "tokens_per_s": speed["tokens_per_s"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.startup", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES + NAMED_CASES)}")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--cpu-smoke", action="store_true", help="generate on a tiny shape")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if unknown := [c for c in cases if c not in CASES + NAMED_CASES]:
        raise ValueError(f"--cases: unknown {unknown}; choose from {list(CASES + NAMED_CASES)}")
    if not torch.cuda.is_available() and not args.cpu_smoke:
        raise SystemExit("bench.startup: no CUDA device here; --cpu-smoke runs the tiny shapes on CPU")
    if "pinning" in cases and args.cpu_smoke:
        raise SystemExit("bench.startup: the pinning case needs CUDA (no --cpu-smoke)")
    result = {**machine(), "toy_steps": TOY_STEPS, "generate": SMOKE_GENERATE if args.cpu_smoke else GENERATE}
    if "qwen3_4b" in cases:
        result["qwen3_4b_batch"] = SMOKE_BATCH_4B if args.cpu_smoke else BATCH_4B
    with tempfile.TemporaryDirectory(prefix="colocate_startup_") as tmp:
        work = pathlib.Path(tmp)
        inputs = write_generate_inputs(work, args.cpu_smoke) if any(c.startswith("generate") for c in cases) else None
        config_4b = write_4b_inputs(work, args.cpu_smoke) if "qwen3_4b" in cases else None
        for case in cases:
            if case == "pinning":
                result["pinning"] = run_pinning()
                write_result(result, args.out)
                continue
            env = cache_env(work / "caches" / case)
            for label in ("cold", "warm"):
                if case == "toy":
                    r = run_toy(work, env, label)
                elif case == "qwen3_4b":
                    r = run_4b(work, env, label, config_4b)
                elif case == "rollout_engine":
                    r = run_rollout_engine(work, env, label, args.cpu_smoke)
                else:
                    r = run_generate(
                        work,
                        env,
                        f"{case}_{label}",
                        inputs,
                        result["generate"]["new_tokens"],
                        "on" if case == "generate_compiled" else "auto",
                    )
                result[f"{case}_{label}"] = r
                parts = {**r.get("init_parts_s", {}), **(r["phases_s"] if case == "qwen3_4b" else {})}
                shown = {k: v for k, v in {**r, **parts}.items() if isinstance(v, float)}
                print(f"{case} {label} -> " + ", ".join(f"{k} {v:.1f}" for k, v in shown.items()), flush=True)
                if case == "qwen3_4b" and r["moves"]:  # what the offloads moved and what they waited for
                    print(f"{case} {label} moves -> " + ", ".join(f"{k} {v:.2f}" for k, v in r["moves"].items()), flush=True)
                write_result(result, args.out)  # after each run: a run cut short keeps what it measured
    write_result(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
