"""Start-up time, cold and warm: the 1-GPU smoke run and offline generation, each a fresh process.

    python bench/startup.py [--cases toy,generate,generate_compiled,rollout_engine] [--out PATH] [--cpu-smoke]

Cases:
  toy       `python -m colocate.train` on configs/default.yaml for 10 steps (`./launch.sh test-gpu`'s
            loop): wall time, the `perf/startup/*` phases it logs, and the steps after start-up.
  generate  `python -m colocate.generate` on a Qwen2.5-0.5B shape (random bf16 weights), 256 prompts
            of 128 token ids x 256 new tokens (ignore_eos): wall time and its start-up line. Its
            default --compile-decode auto leaves this short job's decode uncompiled;
  generate_compiled  the same with --compile-decode on, for the compile's cost beside it.
  rollout_engine  `bench/rollout.py --cases b256 --peers none`: the engine of its rollout figures
            (0.5B shape, decode compiled, CUDA graphs up to 256): its init time and parts, wall
            time, and b256 tok/s (start-up must not cost steady-state speed). With --cpu-smoke
            its tail case on a tiny shape instead.

Each case runs twice in a set of empty cache directories of its own (Triton, inductor, colocate's
toy model and data): "cold" is the first run, as on a fresh CI machine, "warm" the second, caches
filled. (Shared, a case would find the kernels and graphs that an earlier case compiled, such as
generate_compiled's decode layer, which rollout_engine's is too.) Writes bench/results/startup.json.
--cpu-smoke: generate and rollout_engine on a tiny shape (CPU, for tests).
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

from colocate.metrics import read_metrics, split_startup, startup_phases

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "startup.json"
TOY_STEPS = 10
GENERATE = dict(prompts=256, prompt_tokens=128, new_tokens=256)
SMOKE_GENERATE = dict(prompts=8, prompt_tokens=16, new_tokens=8)
SMOKE_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
CASES = ("toy", "generate", "generate_compiled", "rollout_engine")


def cache_env(root: pathlib.Path) -> dict:
    """An environment whose compile caches and colocate cache live under `root`."""
    env = dict(os.environ)
    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("COLOCATE_CACHE", "colocate")):
        env[var] = str(root / sub)
    return env


def timed_run(cmd: list[str], env: dict, log: pathlib.Path, timeout: float = 550) -> float:
    start = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed (rc {done.returncode}); last lines:\n"
                           + "\n".join(log.read_text().splitlines()[-15:]))
    return seconds


def memory_saver_preload(config: pathlib.Path, env: dict) -> dict:
    """The LD_PRELOAD that launch.sh sets on a GPU machine (the engine's pausable CUDA graphs)."""
    out = subprocess.run([sys.executable, "-m", "colocate.memory_saver", str(config)], env=env, cwd=ROOT,
                         capture_output=True, text=True)
    preload = out.stdout.strip()
    return {**env, "LD_PRELOAD": preload} if out.returncode == 0 and preload else env


def run_toy(work: pathlib.Path, env: dict, label: str) -> dict:
    config = ROOT / "configs" / "default.yaml"
    out_dir = work / f"toy_{label}"
    cmd = [sys.executable, "-m", "colocate.train", "--config", str(config), "--output-dir", str(out_dir),
           "--train.num_rollout", str(TOY_STEPS), "--logging.console", "False"]
    env = memory_saver_preload(config, env)  # before the clock starts: it runs a process of its own
    start = time.time()
    wall = timed_run(cmd, env, work / f"toy_{label}.log")
    end = time.time()  # the records' clock: `wall` is monotonic, and the wall clock may be slewed against it
    rows = read_metrics(out_dir)
    startup = startup_phases(rows[0])
    top = sum(split_startup(startup)[0].values())
    first_done = rows[0]["time"] - start
    # What the logged phases leave out: before step 0, the process's spawn and what its phases do
    # not cover (where /proc is missing, the interpreter and imports too); after the last step, the
    # engine's shutdown, the process group's teardown and the exit.
    outside = {"before_startup": first_done - top - rows[0]["perf/step_time"],
               "after_last_step": end - rows[-1]["time"]}
    return {"wall_s": wall, "startup_s": top, "phases_s": startup, "outside_s": outside,
            "first_step_done_s": first_done, "steps_s": rows[-1]["time"] - rows[0]["time"], "steps": len(rows)}


def write_generate_inputs(work: pathlib.Path, smoke: bool) -> tuple[pathlib.Path, pathlib.Path]:
    """A random bf16 model directory (no tokenizer) and a JSONL of token-id prompts."""
    import torch
    from rollout import HF_CONFIG, make_prompts

    from colocate.models import ModelConfig, from_config, save_pretrained

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = {**HF_CONFIG, "model_type": "qwen2", **(SMOKE_SHAPE if smoke else {})}
    model = from_config(ModelConfig.from_hf_dict(shape), torch.bfloat16, device, init=True)
    model_dir = save_pretrained(model, work / "model")
    del model
    prompts = work / "prompts.jsonl"
    sizes = SMOKE_GENERATE if smoke else GENERATE
    ids = make_prompts(sizes["prompts"], sizes["prompt_tokens"], vocab_size=shape["vocab_size"])
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in ids))
    return model_dir, prompts


def run_generate(work: pathlib.Path, env: dict, label: str, inputs, new_tokens: int, compile_decode: str) -> dict:
    model_dir, prompts = inputs
    cmd = [sys.executable, "-m", "colocate.generate", "--model", str(model_dir), "--prompts", str(prompts),
           "--out", str(work / f"generate_{label}.jsonl"), "--max-new-tokens", str(new_tokens), "--ignore-eos",
           "--compile-decode", compile_decode]
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
    cmd = [sys.executable, str(ROOT / "bench" / "rollout.py"), *cases, "--out", str(out)]
    wall = timed_run(cmd, env, work / f"rollout_{label}.log")
    r = json.loads(out.read_text())
    speed = r["tail"] if smoke else r["cases"]["b256"]["ours"]
    return {"wall_s": wall, "init_s": r["engine"]["init_seconds"], "init_parts_s": r["engine"]["init_parts_seconds"],
            "tokens_per_s": speed["tokens_per_s"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--cpu-smoke", action="store_true", help="generate on a tiny shape")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if unknown := [c for c in cases if c not in CASES]:
        raise ValueError(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    import torch

    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "toy_steps": TOY_STEPS,
              "generate": SMOKE_GENERATE if args.cpu_smoke else GENERATE}
    with tempfile.TemporaryDirectory(prefix="colocate_startup_") as tmp:
        work = pathlib.Path(tmp)
        inputs = (write_generate_inputs(work, args.cpu_smoke)
                  if any(c.startswith("generate") for c in cases) else None)
        for case in cases:
            env = cache_env(work / "caches" / case)
            for label in ("cold", "warm"):
                if case == "toy":
                    r = run_toy(work, env, label)
                elif case == "rollout_engine":
                    r = run_rollout_engine(work, env, label, args.cpu_smoke)
                else:
                    r = run_generate(work, env, f"{case}_{label}", inputs, result["generate"]["new_tokens"],
                                     "on" if case == "generate_compiled" else "auto")
                result[f"{case}_{label}"] = r
                shown = {k: v for k, v in {**r, **r.get("init_parts_s", {})}.items() if isinstance(v, float)}
                print(f"{case} {label} -> " + ", ".join(f"{k} {v:.1f}" for k, v in shown.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
