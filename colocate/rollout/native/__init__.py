"""The embedded rollout engine (paged KV cache, continuous batching, CUDA-graph decode)."""

from colocate.rollout.native.engine import NativeEngine

__all__ = ["NativeEngine"]
