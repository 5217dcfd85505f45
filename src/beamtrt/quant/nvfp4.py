"""NVFP4 (E2M1 values, E4M3 per-16 block scales, FP32 global scale) quantization in pure torch."""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Magnitudes of the eight E2M1 codes (bit 3 of a code is the sign); the decode table maps
# code 8 ("-0") to +0.0, as modelopt's does.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_DECODE = _E2M1_MAGNITUDES + tuple(-v if v else 0.0 for v in _E2M1_MAGNITUDES)
# Midpoints between neighbouring magnitudes.  A magnitude equal to a midpoint rounds to the
# neighbour with an even mantissa: down at 0.25, 1.25, 2.5, 5 and up at 0.75, 1.75, 3.5.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_MIDPOINTS = (0.75, 1.75, 3.5)
_SCALE_MIN = 2.0**-9  # smallest E4M3 subnormal; block scales are clamped to [2^-9, 448]


def global_scale(amax: Tensor) -> Tensor:
    """FP32 second-level scale amax / (6 * 448), elementwise; amax [] or [E]."""
    return torch.as_tensor(amax).float() / (E2M1_MAX * E4M3_MAX)


def _check_scale(scale: Tensor, what: str) -> None:
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{what} must be finite and positive, got {scale.flatten()[:8].tolist()}")


def _compute_dtype(x: Tensor) -> torch.dtype:
    if not x.is_floating_point() or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"expected a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    return torch.promote_types(x.dtype, torch.float32)


def _quantize_blocks(x: Tensor, s2: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] (K % 16 == 0), s2 fp32 broadcastable to [..., K/16].

    Returns (E2M1 codes uint8 [..., K], E4M3 block scales [..., K/16]).
    """
    ct = _compute_dtype(x)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)  # [..., K/16, 16]
    block_amax = blocks.abs().amax(dim=-1).float()  # exact: |x| of any input dtype fits fp32 (fp64 aside)
    scale = block_amax / (s2 * E2M1_MAX)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scale_fp8 = scale.clamp(min=_SCALE_MIN, max=E4M3_MAX).to(torch.float8_e4m3fn)
    # One fp32 product per block, then one division per element (the product is rounded first).
    denom = (scale_fp8.float() * s2).unsqueeze(-1)  # [..., K/16, 1]
    scaled = blocks.to(ct) / denom.to(ct)
    mag = scaled.abs()
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=mag.dtype, device=mag.device)
    code = torch.searchsorted(midpoints, mag.contiguous(), out_int32=True).to(torch.uint8)
    for m in _ROUND_UP_MIDPOINTS:
        code += (mag == m).to(torch.uint8)
    code += (scaled < 0).to(torch.uint8) << 3
    return code.reshape(x.shape), scale_fp8


def _decode(code: Tensor, scale_fp8: Tensor, s2: Tensor) -> Tensor:
    """code uint8 [..., K], scale_fp8 [..., K/16], s2 broadcastable to [..., K/16] -> fp32 [..., K]."""
    table = torch.tensor(_E2M1_DECODE, dtype=torch.float32, device=code.device)
    values = table[code.long()]
    values = values.reshape(*code.shape[:-1], code.shape[-1] // BLOCK, BLOCK)
    per_block = scale_fp8.float() * s2  # rounded once per block, as modelopt does
    return (values * per_block.unsqueeze(-1)).reshape(code.shape)


def _scale_2_for(w: Tensor, scale_2: Tensor | float | None) -> tuple[Tensor, Tensor]:
    """Returns (scale_2 as returned [] or w.shape[:-2], the same viewed [..., 1, 1] for broadcasting)."""
    lead = w.shape[:-2]
    if scale_2 is None:
        amax = w.abs().amax(dim=(-2, -1)).float()  # [] or lead
        s2 = global_scale(amax)
        _check_scale(s2, "global scale computed from the weight amax (all-zero or non-finite weight?)")
    else:
        s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=w.device).to(torch.float32)
        if s2.numel() != 1 and s2.shape != lead:
            raise ValueError(f"scale_2 must be a scalar or of shape {tuple(lead)}, got {tuple(s2.shape)}")
        _check_scale(s2, "scale_2")
    s2b = s2.reshape(()) if s2.numel() == 1 else s2.reshape(*lead, 1, 1)
    return s2, s2b


def quantize_weight(w: Tensor, scale_2: Tensor | float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """w [..., out, in] -> (packed uint8 [..., out, in/2], block scales fp8 [..., out, in/16], scale_2 fp32).

    scale_2: fp32 global scale, [] or w.shape[:-2]; None = global_scale(amax of w) per leading index.
    Element 2k of a row goes to the low nibble of byte k, element 2k+1 to the high nibble.
    """
    if w.dim() < 2:
        raise ValueError(f"weight must have at least 2 dims [..., out, in], got shape {tuple(w.shape)}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"weight in_features {w.shape[-1]} is not divisible by {BLOCK}")
    _compute_dtype(w)
    s2, s2b = _scale_2_for(w, scale_2)
    code, scale_fp8 = _quantize_blocks(w, s2b)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, scale_fp8, s2


def dequantize_weight(packed: Tensor, block_scale: Tensor, scale_2: Tensor | float,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """packed uint8 [..., out, in/2], block_scale [..., out, in/16], scale_2 [] or [...] -> [..., out, in]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed weight must be uint8, got {packed.dtype}")
    k = packed.shape[-1] * 2
    if k % BLOCK or block_scale.shape != (*packed.shape[:-1], k // BLOCK):
        raise ValueError(f"block_scale shape {tuple(block_scale.shape)} does not match packed {tuple(packed.shape)}")
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=packed.device).to(torch.float32)
    _check_scale(s2, "scale_2")
    lead = packed.shape[:-2]
    if s2.numel() == 1:
        s2b = s2.reshape(())
    elif packed.dim() >= 2 and s2.shape == lead:
        s2b = s2.reshape(*lead, 1, 1)
    else:
        raise ValueError(f"scale_2 must be a scalar or of shape {tuple(lead)}, got {tuple(s2.shape)}")
    code = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], k)
    return _decode(code, block_scale, s2b).to(dtype)


def fake_quant_activation(x: Tensor, scale_2: Tensor | float) -> Tensor:
    """x [..., K] -> x.dtype [..., K]: NVFP4 quantize-dequantize along K with the calibrated global scale.

    scale_2 = input_scale = act_amax / (6 * 448) (scalar); block scales are dynamic per 16 elements.
    """
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"activation last dim {x.shape[-1] if x.dim() else None} is not divisible by {BLOCK}")
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=x.device).to(torch.float32)
    if s2.numel() != 1:
        raise ValueError(f"activation scale_2 must be a scalar, got shape {tuple(s2.shape)}")
    _check_scale(s2, "scale_2")
    s2 = s2.reshape(())
    code, scale_fp8 = _quantize_blocks(x, s2)
    return _decode(code, scale_fp8, s2).to(x.dtype)
