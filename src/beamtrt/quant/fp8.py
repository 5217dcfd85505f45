"""FP8 E4M3 per-tensor quantization in pure torch (scale = amax / 448)."""

from __future__ import annotations

import torch
from torch import Tensor

E4M3_MAX = 448.0
_AMAX_EPS = 1.0 / (1 << 24)  # modelopt's fake quant treats amax <= 2^-24 as 1.0


def scale_from_amax(amax: Tensor) -> Tensor:
    """FP32 scale amax / 448, elementwise; amax [] or [E]."""
    return torch.as_tensor(amax).float() / E4M3_MAX


def _scale_for(x: Tensor, scale: Tensor | float) -> Tensor:
    """Validates scale ([] or x.shape[:-2] for stacked [E, out, in]) and returns it broadcastable to x, fp32."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).to(torch.float32)
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"FP8 scale must be finite and positive, got {s.flatten()[:8].tolist()}")
    if s.numel() == 1:
        return s.reshape(())
    if x.dim() >= 2 and s.shape == x.shape[:-2]:
        return s.reshape(*s.shape, 1, 1)
    raise ValueError(f"FP8 scale must be a scalar or of shape {tuple(x.shape[:-2])}, got {tuple(s.shape)}")


def _check_float(x: Tensor) -> None:
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"expected a float16/bfloat16/float32/float64 tensor, got {x.dtype}")


def quantize(x: Tensor, scale: Tensor | float) -> Tensor:
    """x [...] (or [E, out, in] with scale [E]) -> float8_e4m3fn [...]: x / scale, clamped to +-448.

    Matches modelopt's weight export `(weight.to(dtype) / weight_scale).to(fp8)` on CPU: the quotient
    is computed in fp32 and rounded to x.dtype before the cast to E4M3 (a double rounding for bf16/fp16).
    """
    _check_float(x)
    s = _scale_for(x, scale)
    ct = torch.promote_types(x.dtype, torch.float32)
    q = (x.to(ct) / s.to(ct)).to(x.dtype)
    return q.clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(q: Tensor, scale: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
    """q float8_e4m3fn [...] -> dtype [...]: q * scale computed in fp32, then cast to dtype."""
    if q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected a float8_e4m3fn tensor, got {q.dtype}")
    s = _scale_for(q, scale)
    return (q.float() * s).to(dtype)


def fake_quant(x: Tensor, scale: Tensor | float) -> Tensor:
    """x [...] -> x.dtype [...]: FP8 quantize-dequantize as a runtime GEMM input sees it.

    Computed in fp32 without an intermediate rounding to x.dtype: e4m3(clamp(x * (1/scale), +-448)) * scale.
    Same formula as modelopt's CPU fake quant (`scaled_e4m3`), which derives its multipliers from amax
    (448/amax and its reciprocal) instead; see fake_quant_from_amax for that exact variant.
    """
    _check_float(x)
    s = _scale_for(x, scale)
    q = (x.float() * (1.0 / s)).clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


def fake_quant_from_amax(x: Tensor, amax: Tensor | float) -> Tensor:
    """x [...] -> x.dtype [...]: bit-identical to modelopt's CPU FP8 fake quant with per-tensor amax."""
    _check_float(x)
    a = torch.as_tensor(amax, dtype=torch.float32, device=x.device).to(torch.float32)
    if a.numel() != 1 or not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise ValueError(f"amax must be one finite non-negative value, got {a.flatten()[:8].tolist()}")
    a = torch.where(a <= _AMAX_EPS, torch.ones_like(a), a).reshape(())
    mult = E4M3_MAX / a
    q = (x.float() * mult).clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * (1 / mult)).to(x.dtype)
