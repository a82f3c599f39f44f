"""The training half: FSDP2 actor, reference and critic, packing, optimizer, offload."""

from colocate.trainer.trainer import Trainer

__all__ = ["Trainer"]
