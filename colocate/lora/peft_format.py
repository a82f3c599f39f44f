"""peft's LoRA adapter directory: adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained` loads onto the base the config names. The tensors are ours under
peft's key names: PEFT_PREFIX + our parameter name (`...q_proj.lora_A.weight`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

PEFT_PREFIX = "base_model.model."
"""peft's prefix of adapter tensor names in adapter_model.safetensors."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_config(lora: dict, base: str | Path) -> dict:
    """adapter_config.json of the adapters `lora` describes (LoRASpec.describe), on the base `base`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": lora["target_modules"],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def write_adapter(directory: Path, lora: dict, adapters: dict[str, torch.Tensor], dtype: torch.dtype, base: str | Path) -> None:
    """Write CONFIG_FILE and WEIGHTS_FILE (`adapters`, by parameter name, in `dtype`) into `directory`."""
    tensors = {PEFT_PREFIX + name: t.to(dtype).contiguous() for name, t in adapters.items()}
    (directory / CONFIG_FILE).write_text(json.dumps(adapter_config(lora, base), indent=2))
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
