"""One GRPO step end to end on one GPU: our colocated loop side by side with TRL's GRPOTrainer.

Model: a Qwen2.5-0.5B-shaped Qwen2 (hidden 896, 24 layers, 14 heads, 2 kv heads, head_dim 64,
intermediate 4864, vocab 151936, tied embeddings, qkv bias), randomly initialised and written once
as bf16 safetensors into a temporary HF directory, with a merge-free Qwen2 byte-level tokenizer
(`byte_level_tokenizer`), so prompts of 128 random letters are exactly 128 tokens.
Batch: 16 prompts x 8 samples x 256 response tokens, temperature 1, no KL (no reference model).
Both sides train fp32 master weights with bf16 compute and take one optimizer step per rollout.

- Ours: `colocate.train.Loop` from a YAML config, with offload on (engine released and trainer
  state moved to pinned host memory every step) and/or off, the trainer's blocks compiled
  (model.compile, the setting for runs longer than a few steps) and/or eager. Response lengths
  are exact because group sampling goes through `fixed_length_generate`
  (rollout.custom_generate), which sets the engine's `ignore_eos`. Reported: median of each
  perf/<phase>_time, of each move of the handoff (handoff/<move>_s) and of the step's wall time
  (between consecutive metric records), over the steps after warm-up. The loop synchronises the
  device at each phase's end, so a phase's queued kernels count in that phase.
- LoRA (`--lora-rank N`): each of our variants runs twice, training every weight and training
  rank-N adapters on the frozen base (model.lora_rank), side by side; the default shape is then
  a Qwen2.5-1.5B-shaped Qwen2 (hidden 1536, 28 layers, 12 heads, 2 kv heads, head_dim 128,
  intermediate 8960). `--shape 8b --lora-rank 64 --lora-only --offload on --skip-trl` runs a
  Qwen3-8B shape (hidden 4096, 36 layers, 32 heads, 8 kv heads, intermediate 12288, untied, q/k
  norms) on 32 prompts x 8 x 1024 response tokens with every block recomputed: training all of
  its weights (fp32 masters and AdamW state, 128 GB) does not fit beside the engine on one GPU.
  Each run reports its peak device memory (the ledger's) and the KV-cache capacity in tokens.
- FP8 rollout (`--rollout-dtype fp8|both`): our engine on FP8 weights and an FP8 KV cache
  (rollout.weight_dtype fp8, rollout.kv_cache_dtype fp8_e4m3; algorithm.use_tis then on by default)
  beside bf16, each run reporting the mismatch metrics' medians (train/mismatch/*). `--shape 4b_step`
  is the Qwen3-4B shape (bench/e2e_tail.py's) on 32 prompts x 8 x 1024 response tokens.
- TRL: GRPOTrainer with transformers' generate (no vLLM), 32-completion micro-batches with 4
  accumulation steps (one generation of 128 completions per optimizer step), gradient
  checkpointing off as in ours, `min_new_tokens` = max_completion_length for exact lengths, in
  each configuration of e2e_trl.CONFIGS (`--trl-configs`; the default one, and bf16 weights with
  Liger's kernels, without and with torch.compile); ratios against the fastest that ran.
  Runs in its own process; `--trl-site DIR` puts DIR (where trl and datasets were installed, e.g.
  from bench/requirements-trl.txt) first on that process's PYTHONPATH only. If it fails, the reason
  is recorded in the JSON.

The reward (`vowel_reward`) is cheap and varies within a group, so advantages are not zero.
Each variant runs in a child process (bench/e2e_ours.py; one CUDA context each; the native
engine's graph memory needs torch_memory_saver's preload hook set before the process starts, as
launch.sh does). Its result goes into the JSON as soon as the child has written it, before the
child's exit (a tail run's went on for over 110 s after its last step on an H100); `result_s` and
`process_s` say when each came.

Run: python -m bench.e2e [--steps 5] [--warmup 2] [--offload both] [--compile on] [--skip-trl]
                         [--max-tokens-per-gpu N[,N...]] [--trl-site DIR] [--trl-configs A,B] [--trace-dir DIR]
                         [--lora-rank N [--lora-only]] [--shape 0.5b|1.5b|8b|4b_step] [--rollout-dtype bf16|fp8|both]
     python -m bench.e2e --cpu-smoke   (tiny model and batch on CPU; checks the script in < 60 s)
     python -m bench.e2e --tail [--partial both] [--over-sampling 4] [--cpu-smoke]   (bench/e2e_tail.py: long-tailed
                         lengths on a Qwen3-4B shape, partial rollout off and on; no TRL)
Writes bench/results/e2e.json (--tail: e2e_tail.json; --cpu-smoke: a file in its temporary
directory unless --out) and prints one summary line. On a cold H200 both of our variants and one
TRL configuration took 5-6 minutes in all (each of our processes compiles and captures the engine's
graphs before its first step).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import platform
import random
import shutil
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import e2e_tail, e2e_trl
from bench.common import RESULTS_DIR, child_env, module_command, write_result
from bench.e2e_ours import PROGRESS, run_ours
from bench.e2e_trl import run_trl

RESULTS = RESULTS_DIR / "e2e.json"
MODULE = "bench.e2e"  # the workers run it; the config's module:function hooks live in it
RESULT_WRITTEN = "result written"
"""The end of the progress line an "ours" worker prints once its result file is complete."""
QWEN2 = dict(model_type="qwen2", tie_word_embeddings=True, attention_bias=True)
SHAPES = {
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        **QWEN2,
    ),
    "1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        **QWEN2,
    ),
    "8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        model_type="qwen3",
        tie_word_embeddings=False,
        qk_norm=True,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        **QWEN2,
    ),
    **e2e_tail.SHAPES,
}
SHAPES["4b_step"] = SHAPES["4b"]
BATCHES = {
    "0.5b": dict(prompts=16, samples_per_prompt=8, prompt_tokens=128, response_tokens=256),
    "1.5b": dict(prompts=16, samples_per_prompt=8, prompt_tokens=128, response_tokens=256),
    "8b": dict(prompts=32, samples_per_prompt=8, prompt_tokens=128, response_tokens=1024),
    "4b_step": dict(prompts=32, samples_per_prompt=8, prompt_tokens=128, response_tokens=1024),
    "tiny": dict(prompts=4, samples_per_prompt=4, prompt_tokens=16, response_tokens=16),
    **e2e_tail.BATCHES,
}
RECOMPUTED = ("8b",)
"""Shapes whose blocks all recompute in backward: 8B activations of a 16k-token micro-batch
would not fit otherwise."""
OURS_TIMEOUT_S = {
    "tiny": 200.0,
    "0.5b": 200.0,
    "1.5b": 300.0,
    "8b": 1800.0,
    "4b_step": 900.0,
    **{shape: e2e_tail.TIMEOUT_S for shape in e2e_tail.SHAPES},
}
TRL_TIMEOUT_S = 300.0
"""Per-process limits that keep a hung run from eating the whole GPU session."""
LR = 1e-6
CHOICES = {"on": [True], "off": [False], "both": [True, False]}


def vowel_reward(prompts: list[str], responses: list[str], labels: list, metadata: list[dict]) -> list[float]:
    """Share of vowels in the response text: cheap, and it differs between samples of one group,
    so the group-relative advantages and the policy update are not zero."""
    return [sum(c in "aeiou" for c in r) / max(len(r), 1) for r in responses]


def fixed_length_generate(engine, prompts, sampling, tokenizer):
    """The default group sampling with the engine's `ignore_eos` set: every completion is exactly
    max_new_tokens long whatever the random model samples, as in the TRL run."""
    from colocate.rollout.sample import Sample

    sampling = [dataclasses.replace(sp, ignore_eos=True) for sp in sampling]
    completions = engine.generate([p.prompt_ids for p in prompts], sampling)
    samples = []
    for c in completions:
        p = prompts[c.prompt_index]
        samples.append(
            Sample(
                prompt_ids=list(p.prompt_ids),
                response_ids=c.output_ids,
                rollout_logprobs=c.logprobs,
                loss_mask=[1] * len(c.output_ids),
                group_index=p.index,
                sample_index=c.sample_index,
                finish_reason=c.finish_reason,
                weight_version=c.weight_version,
                prompt_text=p.prompt_text,
                label=p.label,
                metadata=p.metadata,
            )
        )
    return samples


def byte_level_tokenizer(vocab_size: int):
    """A Qwen2 byte-level BPE tokenizer without merges, the class AutoTokenizer picks for a qwen2
    model directory: ids 0-255 are the 256 byte symbols, so a run of n letters is exactly n tokens;
    the other ids decode to four-letter words (` abaa`, ...); the last id is eos and pad, as in Qwen."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    base = len(vocab)
    # Four letters in base 26 name each id uniquely (26**4 > any vocabulary here).
    vocab.update({"\u0120" + "".join(chr(ord("a") + i // 26**k % 26) for k in range(4)): i for i in range(base, vocab_size - 1)})
    vocab["<|endoftext|>"] = vocab_size - 1
    return Qwen2Tokenizer(vocab=vocab, merges=[])


def write_inputs(workdir: Path, shape: str, num_prompts: int) -> tuple[Path, Path]:
    """The model directory (random bf16 weights + tokenizer) and a JSONL of random-letter prompts.
    The weights are drawn on the GPU when there is one: an 8B shape takes minutes on CPU."""
    import torch

    from colocate.models import ArchConfig, from_config, save_pretrained

    s = SHAPES[shape]
    eos = s["vocab_size"] - 1
    mcfg = ArchConfig(**{"rms_norm_eps": 1e-6, "rope_theta": 1e6, **s}, bos_token_id=eos, eos_token_id=eos)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = save_pretrained(from_config(mcfg, torch.bfloat16, device, init=True), workdir / "model")
    tokenizer = byte_level_tokenizer(s["vocab_size"])
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)
    length = BATCHES[shape]["prompt_tokens"]
    texts = ["".join(rng.choice(string.ascii_lowercase) for _ in range(length)) for _ in range(num_prompts)]
    assert all(len(ids) == length for ids in tokenizer(texts)["input_ids"]), "prompt lengths are not exact"
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "label": ""}) + "\n" for t in texts))
    return model_dir, prompts


def _budget(text: str) -> tuple[int | str, str | None]:
    """`--max-tokens-per-gpu` item: (train.max_tokens_per_gpu, model.recompute_rest or None)."""
    count, _, rest = text.partition(":")
    return (count if count == "auto" else int(count)), rest or None


def ours_config(
    workdir: Path,
    model_dir: Path,
    prompts: Path,
    shape: str,
    name: str,
    offload: bool,
    compile: bool,
    budget: tuple[int | str, str | None] | None,
    num_steps: int,
    lora_rank: int = 0,
    rollout_dtype: str = "bf16",
) -> dict:
    b = BATCHES[shape]
    train = {"num_rollout": num_steps, "lr": LR}
    model = {
        "path": str(model_dir),
        "dtype": "auto",
        "compile": compile,
        "lora_rank": lora_rank,
        "gradient_checkpointing": shape in RECOMPUTED,
    }
    if budget is not None:
        train["max_tokens_per_gpu"], rest = budget
        if rest is not None:
            model["recompute_rest"] = rest
    return {
        "output_dir": str(workdir / f"ours_{name}"),
        "model": model,
        "rollout": {
            "prompt_data": str(prompts),
            "max_prompt_len": b["prompt_tokens"],
            "rollout_batch_size": b["prompts"],
            "n_samples_per_prompt": b["samples_per_prompt"],
            "max_response_len": b["response_tokens"],
            "temperature": 1.0,
            "reward": f"{MODULE}:vowel_reward",
            "custom_generate": f"{MODULE}:fixed_length_generate",
            **(dict(weight_dtype="fp8", kv_cache_dtype="fp8_e4m3") if rollout_dtype == "fp8" else {}),
        },
        "algorithm": {"advantage_estimator": "grpo"},
        "train": train,
        "offload": {"offload_rollout": offload, "offload_train": offload},
        "checkpoint": {"save_interval": None, "save_on_exit": False, "resume": False},
        "logging": {"wandb": False, "console": False},
    }


def _child(args: list[str], env: dict, timeout: float, on_result=None) -> dict:
    """Run this script as a worker: its result, or {"error": last line, "output_tail": ...}. Its
    progress lines are echoed as they come, so a run cut short by an outer time limit still says
    how far it got. A worker that says its result is written (RESULT_WRITTEN) has it handed to
    `on_result` at once, before the process's exit, which can take minutes (an outer limit may
    cut that off); `result_s` is when that was, `process_s` when the process ended."""
    start = time.perf_counter()
    out = Path(args[args.index("--result") + 1])
    proc = subprocess.Popen(
        module_command(MODULE, *args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    tail: collections.deque[str] = collections.deque(maxlen=400)
    result_s = None
    for line in proc.stdout:
        tail.append(line)
        if line.startswith(PROGRESS):
            print(line.rstrip(), file=sys.stderr, flush=True)
        if line.startswith(PROGRESS) and line.rstrip().endswith(RESULT_WRITTEN) and on_result is not None:
            result_s = time.perf_counter() - start
            on_result({**json.loads(out.read_text()), "result_s": result_s})
    returncode = proc.wait()
    timer.cancel()
    output = "".join(tail)
    if time.perf_counter() - start >= timeout:
        return {"error": f"timed out after {timeout:.0f} s", "output_tail": output[-3000:]}
    if returncode != 0 or not out.exists():
        lines = [line for line in output.splitlines() if line.strip()]
        return {"error": f"exit code {returncode}: {lines[-1] if lines else 'no output'}", "output_tail": output[-3000:]}
    return {**json.loads(out.read_text()), "result_s": result_s, "process_s": time.perf_counter() - start}


def _child_env(extra_path: str | None = None, preload: bool = False, cpu: bool = False) -> dict:
    env = child_env(extra_path)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if preload:
        from colocate.memory_saver import with_preload

        env = with_preload(env)
    return env


def _write(results: dict, out: Path) -> None:
    """Ratios from what has run so far, then the JSON (after each run: a cut-short run keeps its data)."""
    results["trl_fastest"] = e2e_trl.fastest(results["trl"])
    trl_s = results["trl_fastest"] and results["trl"][results["trl_fastest"]]["step_median_s"]
    ours = results["ours"]
    results["ratio_trl_over_ours"] = {
        name: trl_s / e["step_median_s"] for name, e in ours.items() if trl_s and e.get("step_median_s")
    }
    full = {name[len("full_") :]: e.get("step_median_s") for name, e in ours.items() if name.startswith("full_")}
    results["ratio_full_over_lora"] = {
        name: full[name.split("_", 1)[1]] / e["step_median_s"]
        for name, e in ours.items()
        if name.startswith("lora") and full.get(name.split("_", 1)[1]) and e.get("step_median_s")
    }
    write_result(results, out)


def orchestrate(args, out: Path, workdir: Path) -> dict:
    import torch
    import transformers
    import yaml

    if args.tail:
        shape = "tiny_tail" if args.cpu_smoke else "4b"
    else:
        shape = "tiny" if args.cpu_smoke else args.shape or ("1.5b" if args.lora_rank else "0.5b")
    steps = args.steps or (1 if args.cpu_smoke else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.cpu_smoke else 2)
    start = time.perf_counter()
    num_prompts = BATCHES[shape]["prompts"] * (warmup + steps + 1)
    # In a child process, so that this one never holds a CUDA context beside the runs it times.
    made = _child(
        [
            "--worker",
            "inputs",
            "--worker-shape",
            shape,
            "--num-prompts",
            str(num_prompts),
            "--workdir",
            str(workdir),
            "--result",
            str(workdir / "inputs.json"),
        ],
        _child_env(cpu=args.cpu_smoke),
        OURS_TIMEOUT_S[shape],
    )
    if "error" in made:
        raise RuntimeError(f"writing the {shape} model and prompts failed: {made['error']}\n{made['output_tail']}")
    model_dir, prompts = Path(made["model_dir"]), Path(made["prompts"])
    results = {
        "machine": {
            "host": socket.gethostname(),
            "device": None,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "shape": SHAPES[shape],
        "batch": BATCHES[shape],
        "weights": "random init, bf16 safetensors on disk; both trainers keep fp32 master weights (LoRA: "
        "a frozen base in the compute dtype, fp32 adapters); compute and our engine's weights "
        "are bf16 on GPU, fp32 on CPU",
        "warmup_steps": warmup,
        "timed_steps": steps,
        "workdir": str(workdir),
        "ours": {},
        "trl": {"skipped": True} if args.skip_trl or args.tail else {},
        "ratio_trl_over_ours": {},
        "ratio_full_over_lora": {},
    }
    env = _child_env(preload=not args.cpu_smoke, cpu=args.cpu_smoke)
    compiles = CHOICES[args.compile or ("off" if args.cpu_smoke else "on")]
    budgets = args.max_tokens_per_gpu or [None]
    ranks = ([] if args.lora_only else [0]) + ([args.lora_rank] if args.lora_rank else [])
    # The tail run's variants are partial rollout off and on, with offload on.
    offloads, partials = ([True], CHOICES[args.partial]) if args.tail else (CHOICES[args.offload], [None])
    dtypes = ["bf16", "fp8"] if args.rollout_dtype == "both" else [args.rollout_dtype]
    for rank, offload, compile, budget, partial, dtype in [
        (r, o, c, m, p, d) for r in ranks for o in offloads for c in compiles for m in budgets for p in partials for d in dtypes
    ]:
        name = "_".join(
            part
            for part in (
                (f"lora{rank}" if rank else "full") if rank or len(ranks) > 1 else "",
                f"offload_{'on' if offload else 'off'}",
                f"compile_{'on' if compile else 'off'}" if len(compiles) > 1 else "",
                f"tokens_{budget[0]}{'_' + budget[1] if budget[1] else ''}" if len(budgets) > 1 else "",
                f"partial_{'on' if partial else 'off'}" if partial is not None else "",
                f"rollout_{dtype}" if len(dtypes) > 1 else "",
            )
            if part
        )
        profiled = args.trace_dir is not None
        cfg = ours_config(
            workdir, model_dir, prompts, shape, name, offload, compile, budget, warmup + steps + profiled, rank, dtype
        )
        if args.tail:
            cfg = e2e_tail.tail_config(cfg, shape, partial, args.over_sampling)
        cfg_path = workdir / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        trace = ["--trace", str(args.trace_dir / f"e2e_{name}.json.gz")] if profiled else []
        tail = ["--tail-shape", shape] if args.tail else []

        def keep(result, name=name, cfg=cfg):
            results["ours"][name] = {"config": cfg, **result}
            _write(results, out)

        result = _child(
            [
                "--worker",
                "ours",
                "--config",
                str(cfg_path),
                "--warmup",
                str(warmup),
                *trace,
                *tail,
                "--result",
                str(workdir / f"result_{name}.json"),
            ],
            env,
            OURS_TIMEOUT_S[shape],
            keep,
        )
        results["ours"][name] = {"config": cfg, **result}
        results["machine"]["device"] = results["machine"]["device"] or result.get("device")
        _write(results, out)
    if not (args.skip_trl or args.tail):
        env = _child_env(extra_path=args.trl_site, cpu=args.cpu_smoke)
        for name in args.trl_configs:
            results["trl"][name] = _child(
                [
                    "--worker",
                    "trl",
                    "--trl-config",
                    name,
                    "--model-dir",
                    str(model_dir),
                    "--prompts",
                    str(prompts),
                    "--worker-shape",
                    shape,
                    "--steps",
                    str(steps),
                    "--warmup",
                    str(warmup),
                    "--result",
                    str(workdir / f"result_trl_{name}.json"),
                ],
                env,
                TRL_TIMEOUT_S,
            )
            _write(results, out)
    shutil.rmtree(model_dir)  # the largest file by far; configs and metrics stay for inspection
    results["total_s"] = time.perf_counter() - start
    _write(results, out)
    return results


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def summary(results: dict) -> str:
    b = results["batch"]
    parts = [
        f"e2e GRPO step ({results['machine']['device']}, {b['prompts']}x{b['samples_per_prompt']}x{b['response_tokens']} tok):"
    ]
    for name, e in results["ours"].items():
        if "error" in e:
            parts.append(f"ours {name} FAILED ({e['error']})")
            continue
        phases = ", ".join(f"{k} {v:.3f}" for k, v in e["phase_median_s"].items() if v is not None)
        parts.append(
            f"ours {name} {_fmt(e['step_median_s'])} s ({phases}; len {_fmt(e['response_len_mean'], '.0f')}; "
            f"peak {_fmt(e['peak_device_used_gib'], '.1f')} GiB; KV {e['kv_cache_tokens']} tok; "
            f"mismatch max {_fmt(e.get('mismatch_median', {}).get('abs_diff_max'))})"
        )
        parts += e2e_tail.summary(e)
    parts += e2e_trl.summary(results["trl"])
    for name, r in results["ratio_trl_over_ours"].items():
        parts.append(f"| TRL {results['trl_fastest']}/ours {name} {r:.2f}x")
    for name, r in results["ratio_full_over_lora"].items():
        parts.append(f"| full/LoRA {name} {r:.2f}x")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 5; --cpu-smoke 1)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2; --cpu-smoke 1)")
    parser.add_argument("--offload", choices=tuple(CHOICES), default="both")
    parser.add_argument(
        "--compile",
        choices=tuple(CHOICES),
        default=None,
        help="model.compile of ours: torch.compile the trainer's transformer blocks (default on; --cpu-smoke: off)",
    )
    parser.add_argument(
        "--max-tokens-per-gpu",
        type=lambda v: [_budget(x) for x in v.split(",")],
        default=None,
        help="train.max_tokens_per_gpu of ours, comma-separated for several runs, each a count, "
        "`auto`, or COUNT:REST to set model.recompute_rest too (default: the config's)",
    )
    parser.add_argument(
        "--trace-dir", type=Path, default=None, help="profile one extra step of each of our runs (not timed) into DIR"
    )
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--trl-site", default=None, help="directory with trl and datasets, for the TRL process")
    parser.add_argument(
        "--trl-configs",
        type=lambda v: v.split(","),
        default=list(e2e_trl.CONFIGS),
        help="comma-separated TRL configurations, from: " + ", ".join(e2e_trl.CONFIGS),
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model and batch on CPU")
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="also run each of our variants with LoRA adapters of this rank (default shape 1.5b)",
    )
    parser.add_argument("--lora-only", action="store_true", help="with --lora-rank: leave out full training")
    parser.add_argument(
        "--shape",
        choices=[s for s in SHAPES if s != "tiny" and s not in e2e_tail.SHAPES],
        default=None,
        help="model shape (default 0.5b; 1.5b with --lora-rank; --cpu-smoke: a tiny one)",
    )
    parser.add_argument(
        "--tail", action="store_true", help="long-tailed lengths on a Qwen3-4B shape, offload on (bench/e2e_tail.py)"
    )
    parser.add_argument("--partial", choices=tuple(CHOICES), default="both", help="--tail: partial rollout")
    parser.add_argument(
        "--over-sampling",
        type=int,
        default=4,
        help="--tail with partial rollout: groups in flight, in multiples of a step's (default 4)",
    )
    parser.add_argument(
        "--rollout-dtype",
        choices=("bf16", "fp8", "both"),
        default="bf16",
        help="our engine's weights and KV cache: bf16, or FP8 (rollout.weight_dtype fp8, rollout.kv_cache_dtype fp8_e4m3)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/e2e.json)")
    for hidden in (
        "--worker",
        "--config",
        "--model-dir",
        "--prompts",
        "--result",
        "--trace",
        "--tail-shape",
        "--worker-shape",
        "--num-prompts",
        "--workdir",
        "--trl-config",
    ):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if set(args.trl_configs) - set(e2e_trl.CONFIGS):
        raise ValueError(f"--trl-configs: unknown {args.trl_configs}; known: {', '.join(e2e_trl.CONFIGS)}")
    if args.lora_rank < 0 or (args.lora_only and not args.lora_rank):
        raise ValueError(f"--lora-rank must be >= 1 with --lora-only and >= 0 otherwise, got {args.lora_rank}")
    if args.worker == "ours":
        result = run_ours(Path(args.config), args.warmup, Path(args.trace) if args.trace else None, args.tail_shape)
    elif args.worker == "inputs":
        model_dir, prompts = write_inputs(Path(args.workdir), args.worker_shape, int(args.num_prompts))
        result = {"model_dir": str(model_dir), "prompts": str(prompts)}
    elif args.worker == "trl":
        result = run_trl(
            Path(args.model_dir),
            Path(args.prompts),
            BATCHES[args.worker_shape],
            args.steps,
            args.warmup,
            LR,
            vowel_reward,
            args.trl_config,
        )
    else:
        workdir = Path(tempfile.mkdtemp(prefix="colocate_e2e_"))
        if args.trace_dir is not None:
            args.trace_dir.mkdir(parents=True, exist_ok=True)
        out = args.out or (
            workdir / "e2e.json" if args.cpu_smoke else RESULTS.with_name("e2e_tail.json") if args.tail else RESULTS
        )
        results = orchestrate(args, out, workdir)
        print(summary(results), flush=True)
        print(f"wrote {out}")
        return 0 if all("error" not in e for e in results["ours"].values()) else 1
    Path(args.result).write_text(json.dumps(result, indent=2))
    if args.worker == "ours":
        print(f"{PROGRESS} {Path(args.config).stem} {RESULT_WRITTEN}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
