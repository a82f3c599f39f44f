"""Triton kernels, each with an asserting launcher and the plain-torch reference used on CPU.

Importing this package never imports triton: the kernels are defined on first CUDA use.
"""

from colocate.kernels.logprob import reference_token_logprobs, token_logprobs
from colocate.kernels.paged_attention import (
    paged_decode_attention,
    reference_paged_decode_attention,
    store_kv,
)
from colocate.kernels.rotary import reference_rotate, rotate

__all__ = [
    "paged_decode_attention",
    "reference_paged_decode_attention",
    "reference_rotate",
    "reference_token_logprobs",
    "rotate",
    "store_kv",
    "token_logprobs",
]
