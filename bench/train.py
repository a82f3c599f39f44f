"""Trainer throughput on one GPU: tokens/s, MFU and peak memory of our FSDP2 trainer on packed
mixed-length sequences, side by side with transformers + FSDP2 on a padded batch, in one run;
plus the trainer's offload/onload bandwidth for both methods.

Shapes: Qwen2.5-0.5B and -1.5B (random init). Ours: GRPO steps through `Trainer.train` on packed
samples of 160..4160 tokens, 16k-token micro-batches, bf16 compute / fp32 master weights, fused
AdamW, the Triton log-prob kernel; a few activation-checkpointing strides, compiled blocks.
Baseline: AutoModelForCausalLM (sdpa) + FSDP2 (bf16 params, fp32 reduce), fused AdamW, 8 x 2048
padded batch, fp32 logits and cross-entropy.

MFU counts model FLOPs the way the baseline figure in docs/MEASURED.md does (PaLM): 6 N per token
plus 12 * layers * (heads * head_dim) * L per token of a length-L sequence (non-causal attention),
against 989 TFLOP/s dense bf16 (H200). Recomputation by activation checkpointing is not counted.
Peak memory is torch.cuda.max_memory_allocated over the measured steps, states included.

Run: python bench/train.py [--models 1.5b,0.5b] [--steps 3]
Writes bench/results/train.json and prints one summary line per model.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import random
import time

import torch
import torch.nn.functional as F

from colocate import dist
from colocate.config import Config
from colocate.models import CausalLM, ModelConfig
from colocate.rollout.sample import Sample

RESULTS = pathlib.Path(__file__).parent / "results" / "train.json"
PEAK_TFLOPS = 989.0
MICRO_BATCH_TOKENS = 16384
STEP_TOKENS = 2 * MICRO_BATCH_TOKENS
GROUP = 4
SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
}
# (compile, checkpoint every k-th block; 0 = none): the strides trade recompute for memory.
VARIANTS = {
    "0.5b": [(True, 0), (False, 0)],
    "1.5b": [(True, 1), (True, 2), (True, 3), (False, 1)],
}


def model_config(name: str) -> ModelConfig:
    s = SHAPES[name]
    return ModelConfig(model_type="qwen2", vocab_size=151936, head_dim=s["hidden_size"] // s["num_attention_heads"],
                       rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, attention_bias=True, **s)


def num_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(cfg).parameters())


def model_flops(cfg: ModelConfig, seq_lengths: list[int]) -> float:
    attn = 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * sum(n * n for n in seq_lengths)
    return 6.0 * num_params(cfg) * sum(seq_lengths) + attn


def make_samples(rng: random.Random, vocab: int) -> list[Sample]:
    """Groups of GROUP samples (a shared 32..64-token prompt, 128..4096 response tokens each),
    as many as fit in STEP_TOKENS."""
    samples, total = [], 0
    while True:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(32, 64))]
        lengths = [rng.randint(128, 4096) for _ in range(GROUP)]
        if samples and total + sum(len(prompt) + n for n in lengths) > STEP_TOKENS:
            return samples
        group = len(samples) // GROUP
        for j, n in enumerate(lengths):
            samples.append(Sample(prompt, [rng.randrange(vocab) for _ in range(n)], [0.0] * n, [1] * n, group, j,
                                  reward=rng.random()))
            total += len(prompt) + n


def _config(num_samples: int, compiled: bool, method: str = "pinned") -> Config:
    cfg = Config()
    cfg.model.compile = compiled
    cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size = GROUP, num_samples // GROUP
    cfg.train.max_tokens_per_gpu, cfg.train.lr, cfg.train.num_rollout = MICRO_BATCH_TOKENS, 1e-6, 1000
    cfg.offload.method = method
    return cfg


def _free():
    gc.collect()
    torch.cuda.empty_cache()


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_ours(name: str, compiled: bool, checkpoint_every: int, steps: int, info) -> tuple[dict, object]:
    from colocate.trainer import Trainer

    mcfg = model_config(name)
    rng = random.Random(0)
    batches = [make_samples(rng, mcfg.vocab_size) for _ in range(2 + steps)]
    base = torch.cuda.memory_allocated()
    trainer = Trainer(_config(len(batches[0]), compiled), info, model_config=mcfg, checkpoint_every=checkpoint_every)
    warmup_s = sum(_timed(lambda b=b: trainer.train(b, 0)) for b in batches[:2])
    torch.cuda.reset_peak_memory_stats()
    seconds, tokens, flops, metrics = 0.0, 0, 0.0, {}
    for batch in batches[2:]:
        lengths = [len(s.tokens) for s in batch]
        seconds += _timed(lambda b=batch: metrics.update(trainer.train(b, 1)))
        tokens += sum(lengths)
        flops += model_flops(mcfg, lengths)
    peak = torch.cuda.max_memory_allocated() - base
    return dict(compile=compiled, checkpoint_every=checkpoint_every, tokens_per_s=tokens / seconds,
                mfu=flops / seconds / (PEAK_TFLOPS * 1e12), peak_gib=peak / 2**30, warmup_s=warmup_s,
                step_tokens=tokens / steps, grad_norm=metrics.get("train/grad_norm")), trainer


def bench_hf(name: str, steps: int) -> dict:
    """The transformers + FSDP2 baseline on an 8 x 2048 batch."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, Qwen2Config

    from colocate.trainer.optim import clip_grad_norm

    mcfg = model_config(name)
    hf_cfg = Qwen2Config(vocab_size=mcfg.vocab_size, hidden_size=mcfg.hidden_size,
                         intermediate_size=mcfg.intermediate_size, num_hidden_layers=mcfg.num_hidden_layers,
                         num_attention_heads=mcfg.num_attention_heads, num_key_value_heads=mcfg.num_key_value_heads,
                         tie_word_embeddings=True, max_position_embeddings=32768)
    base = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, mcfg.vocab_size, (8, 2048), device="cuda", generator=gen)

    def step():
        logits = model(input_ids=ids).logits.float()  # (8, 2048, V) fp32
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, mcfg.vocab_size), ids[:, 1:].reshape(-1))
        loss.backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        _timed(step)
    torch.cuda.reset_peak_memory_stats()
    seconds = sum(_timed(step) for _ in range(steps))
    peak = torch.cuda.max_memory_allocated() - base
    tokens = ids.numel() * steps
    return dict(tokens_per_s=tokens / seconds, mfu=model_flops(mcfg, [2048] * 8) * steps / seconds / (PEAK_TFLOPS * 1e12),
                peak_gib=peak / 2**30)


def bench_offload(trainer, rounds: int = 2) -> list[dict]:
    """Offload everything, then onload, `rounds` times (the first pinned round allocates)."""
    out = []
    for _ in range(rounds):
        off = trainer.offload(keep_params=False)
        on = trainer.onload()
        out.append(dict(gib=off.num_bytes / 2**30, offload_s=off.seconds, onload_s=on.seconds,
                        offload_gb_per_s=off.gb_per_s, onload_gb_per_s=on.gb_per_s))
    return out


def _guarded(fn, *args):
    """Run one measurement; a failure (e.g. out of memory, a compile error) is recorded, not fatal."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and moves on
        error = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    _free()  # after the except block, which drops the traceback (and the tensors its frames hold)
    return error


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="1.5b,0.5b", help="comma-separated, from: " + ", ".join(SHAPES))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    info = dist.init()
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "peak_tflops": PEAK_TFLOPS, "models": {}}
    for name in args.models.split(","):
        entry = results["models"][name] = {"params": num_params(model_config(name)), "ours": []}
        for compiled, every in VARIANTS[name]:
            out = _guarded(bench_ours, name, compiled, every, args.steps, info)
            run, trainer = out if isinstance(out, tuple) else (out, None)
            entry["ours"].append(run)
            if trainer is not None and name == "0.5b" and "offload_pinned" not in entry:
                entry["offload_pinned"] = _guarded(bench_offload, trainer)
            del trainer
            _free()
        if name == "0.5b":
            entry["offload_tms"] = _guarded(_tms_offload, name, info)
        entry["hf_fsdp2"] = _guarded(bench_hf, name, args.steps)
        _free()
        print(_summary(name, entry), flush=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=2))  # after each model: a cut-short run keeps its data
    dist.destroy()


def _tms_offload(name: str, info) -> list[dict]:
    from colocate.trainer import Trainer

    mcfg = model_config(name)
    batch = make_samples(random.Random(1), mcfg.vocab_size)
    trainer = Trainer(_config(len(batch), compiled=False, method="tms"), info, model_config=mcfg, checkpoint_every=1)
    trainer.train(batch, 0)
    return bench_offload(trainer)


def _summary(name: str, entry: dict) -> str:
    hf = entry["hf_fsdp2"]
    runs = [r for r in entry["ours"] if "error" not in r]
    if not runs or "error" in hf:
        return f"{name}: ours {runs[0] if runs else entry['ours']} | hf+fsdp2 {hf}"
    fitting = [r for r in runs if r["peak_gib"] <= 0.4 * hf["peak_gib"]]
    best = max(fitting or runs, key=lambda r: r["mfu"])
    line = (f"{name}: ours {best['mfu']:.1%} MFU, {best['tokens_per_s'] / 1e3:.1f}k tok/s, "
            f"{best['peak_gib']:.1f} GiB peak (compile={best['compile']}, ac every {best['checkpoint_every']}) | "
            f"hf+fsdp2 {hf['mfu']:.1%} MFU, {hf['tokens_per_s'] / 1e3:.1f}k tok/s, {hf['peak_gib']:.1f} GiB | "
            f"memory ratio {best['peak_gib'] / hf['peak_gib']:.2f}")
    for key in ("offload_pinned", "offload_tms"):
        rounds = entry.get(key)
        if isinstance(rounds, list):
            last = rounds[-1]
            line += (f" | {key.split('_')[1]} offload {last['offload_gb_per_s']:.1f} GB/s, "
                     f"onload {last['onload_gb_per_s']:.1f} GB/s")
    return line


if __name__ == "__main__":
    main()
