"""FP8 (e4m3) weights and activations: the rollout engine's `rollout.weight_dtype: fp8`.

Two layouts of a quantized weight W (N, K):

- **row-wise** (what the engine computes with): W ~ W8 * scale[:, None], one fp32 scale per output
  row, scale = amax(|row|) / 448. A projection then runs as one `torch._scaled_mm` with the input
  quantized per token (x ~ x8 * s[:, None]): y = (x8 @ W8^T) * s * scale, FP8 tensor cores on Hopper
  and later, half the weight bytes of bf16 read per decode step. Row scales are independent, so the
  engine's packed q/k/v and gate/up tensors quantize as their parts do.
- **block-wise** (the published FP8 checkpoints, e.g. Qwen3-*-FP8): W ~ W8 * S[i // 128, j // 128],
  the checkpoint's `weight_scale_inv` (ceil(N/128), ceil(K/128)) fp32. Loading dequantizes them
  (`block_dequantize`); `block_quantize` writes that layout (tests make their own checkpoints with it).

e4m3 keeps 3 mantissa bits: a value's relative rounding error is at most 2^-4 (6.25%) in the normal
range, and a row's largest value is represented exactly up to that rounding.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
AMAX_FLOOR = 1e-12
"""Floor of an amax, so an all-zero row gets a finite scale (and quantizes to zeros)."""


def quantize_rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N, K) -> (W8 (N, K) e4m3, scale (N,) fp32) with W ~ W8 * scale[:, None]."""
    scale = w.detach().abs().amax(dim=-1).float().clamp(min=AMAX_FLOOR) / E4M3_MAX
    return (w.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_rowwise_into(w: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor) -> None:
    """`quantize_rowwise(w)` written into existing tensors (the engine's weights, which CUDA graphs
    and packed views point at), on w's device: no host round trip."""
    w8, scale = quantize_rowwise(w.to(out.device))
    out.copy_(w8)
    out_scale.copy_(scale)


def dequantize_rowwise(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (w8.float() * scale.float()[:, None]).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (M, K) -> (x8 (M, K) e4m3, scale (M, 1) fp32), one scale per row (token)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=AMAX_FLOOR) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ (W8 * scale[:, None])^T + bias in x's dtype: x quantized per token, one scaled
    FP8 GEMM accumulating in fp32 (`torch._scaled_mm`, row-wise scales; traceable, so the compiled
    decode fuses the quantization into the kernels around it)."""
    lead = x.shape[:-1]
    x8, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
    if x.is_cuda:
        out = torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)
    else:  # the same product in fp32 (torch's CPU FP8 GEMM takes one scale per tensor only in some versions)
        out = ((x8.float() * x_scale) @ (w8.float() * scale.float()[:, None]).T).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*lead, w8.shape[0])


def block_dequantize(
    w8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """A block-quantized checkpoint weight (N, K) e4m3 and its `weight_scale_inv` (ceil(N/bn),
    ceil(K/bk)) -> the weight in `dtype`."""
    n, k = w8.shape
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}; a ({n}, {k}) weight in {bn}x{bk} blocks needs {expected}"
        )
    scales = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w8.float() * scales).to(dtype)


def block_quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """W (N, K) -> (W8 e4m3, scale_inv (ceil(N/bn), ceil(K/bk)) fp32): one scale per block, its
    amax / 448, as the published FP8 checkpoints hold them."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / E4M3_MAX  # (rows, cols)
    w8 = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return w8.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale_inv
