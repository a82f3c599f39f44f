"""colocate: single-node RL post-training with the trainer and the rollout engine on each GPU."""

__version__ = "0.1.0"
