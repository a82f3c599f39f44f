"""The peer side of `bench/e2e.py`: TRL's GRPOTrainer timed on the same model, prompts and batch.

transformers' generate (no vLLM), 32-completion micro-batches accumulated to one optimizer step
per generation, gradient checkpointing off, `min_new_tokens` = the response length for exact
lengths, in each of CONFIGS. Imported only in the child process that runs TRL, so trl and datasets
are needed there only (liger-kernel too, for the configurations that use it).

TRL 1.16's GRPOTrainer already takes its log-probs through a chunked LM head (no full logits) and
its GRPOConfig has no Liger loss: `use_liger_kernel` swaps in Liger's layer kernels (RMSNorm, RoPE,
SwiGLU) and keeps that head. Generation runs on the weights as loaded: fp32 under bf16 autocast
unless the model is loaded in bf16, which then also trains in bf16 (no fp32 master weights).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from bench.common import median

TRL_MICRO_BATCH = 32
CONFIGS = {
    "default": {},
    "bf16_liger": {"model_init_kwargs": {"dtype": "bfloat16"}, "use_liger_kernel": True},
    "bf16_liger_compile": {"model_init_kwargs": {"dtype": "bfloat16"}, "use_liger_kernel": True, "torch_compile": True},
}
"""GRPOConfig settings over the default one: "default" loads fp32 weights (trained as fp32 masters
under bf16 autocast, generation casting them at every step); the others load bf16 weights, add
Liger's kernels and, last, torch.compile of the model (TrainingArguments.torch_compile)."""


def fastest(trl: dict) -> str | None:
    """The configuration with the shortest median step among those that ran."""
    ran = {name: r["step_median_s"] for name, r in trl.items() if isinstance(r, dict) and r.get("step_median_s")}
    return min(ran, key=ran.get) if ran else None


def summary(trl: dict) -> list[str]:
    parts = []
    for name, r in trl.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            parts.append(f"| TRL {name} FAILED ({r['error']})")
        elif r.get("step_median_s") is not None:
            gen, length = r.get("generate_median_s"), r.get("response_len_mean")
            parts.append(
                f"| TRL {name} {r['step_median_s']:.3f} s (generate "
                f"{'-' if gen is None else f'{gen:.3f}'}; len {'-' if length is None else f'{length:.0f}'})"
            )
    return parts


def run_trl(
    model_dir: Path, prompts: Path, batch: dict, steps: int, warmup: int, lr: float, reward_fn: Callable, config_name: str
) -> dict:
    """TRL's GRPOTrainer (transformers generate) on the same model, prompts and batch, with
    `reward_fn(prompts, responses, labels, metadata)` as its reward, in CONFIGS[config_name]."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    b = batch
    cuda = torch.cuda.is_available()
    total = b["prompts"] * b["samples_per_prompt"]
    micro = min(TRL_MICRO_BATCH, total)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    train = datasets.Dataset.from_dict({"prompt": [r["prompt"] for r in rows]})

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class StepClock(TrainerCallback):
        """Wall seconds between the ends of consecutive optimizer steps, and completion lengths."""

        def __init__(self):
            self.last, self.steps, self.lengths = 0.0, [], []

        def on_train_begin(self, args, state, control, **kwargs):
            sync()
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            now = time.perf_counter()
            self.steps.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    generate_s: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """Records the seconds of each generation (transformers generate + decoding)."""

        def _generate(self, *args, **kwargs):
            sync()
            start = time.perf_counter()
            out = super()._generate(*args, **kwargs)
            sync()
            generate_s.append(time.perf_counter() - start)
            return out

    def reward(prompts, completions, **kwargs):
        return reward_fn(prompts, completions, [], [])

    config = dict(
        output_dir=str(model_dir.parent / "trl_out"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=total // micro,
        num_generations=b["samples_per_prompt"],
        max_completion_length=b["response_tokens"],
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        generation_kwargs={"min_new_tokens": b["response_tokens"]},
        learning_rate=lr,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        max_steps=warmup + steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=1,
    )
    config.update(CONFIGS[config_name])
    clock = StepClock()
    trainer = TimedGRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward,
        args=GRPOConfig(**config),
        train_dataset=train,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[clock],
    )
    trainer.train()
    timed = clock.steps[warmup:]
    return {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "datasets": datasets.__version__,
            "torch": torch.__version__,
        },
        "config_name": config_name,
        "config": {k: v for k, v in config.items() if k != "output_dir"},
        "steps_s": timed,
        "step_median_s": median(timed),
        "generate_median_s": median(generate_s[warmup:]),
        "response_len_mean": median(clock.lengths[warmup:]),
    }
