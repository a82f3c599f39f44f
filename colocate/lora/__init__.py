"""LoRA's definitions, below every layer that uses them: the trainer's adapted modules
(colocate/trainer/lora.py), the weight sync, checkpoints and the export.

- `TARGET_MODULES` (here): the projections that can carry adapters;
- identity.py: `LoRASpec`, the adapters' parameter names, and the base they belong to (the SHA-256
  of its config.json, a fingerprint of its weights, `check_same_adapters`);
- merge.py: `merged_weight`, W + (alpha / rank) B A, the weight the rollout engine holds and the
  export writes;
- peft_format.py: peft's adapter directory (adapter_config.json, adapter_model.safetensors).

This file imports nothing, so colocate.config reads the default targets without importing torch.
"""

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear projections of a block that can carry LoRA adapters (attention's, then the MLP's);
all of them by default."""
