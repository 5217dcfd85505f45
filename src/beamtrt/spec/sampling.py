"""The target's sampling settings and distribution, shared by plain and speculative decoding (exactness needs one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


MIN_TEMPERATURE = 1e-5  # below it logits / T overflows to inf in fp32 and the distribution turns to NaN; 0 is greedy


TOP_P_FLOOR = 2.0**-150  # half float32's smallest subnormal: a top_p at or below it is 0 as a float32


def top_p_ok(top_p: float) -> bool:
    """In (0, 1], and not 0 as the float32 the probabilities are compared with (at or below TOP_P_FLOOR, ~7e-46, it
    would drop every token, and the distribution turn to NaN). A comparison: the sampled walk checks it every slot."""
    return TOP_P_FLOOR < top_p <= 1  # NaN fails too


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 = no top-k cut

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf) \
                or not top_p_ok(self.top_p) or self.top_k < 0:  # NaN fails too
            raise ValueError(f"bad sampling settings: temperature={self.temperature} (0 = greedy, or finite and >= "
                             f"{MIN_TEMPERATURE:g}), top_p={self.top_p} (in (0, 1], at least 1e-45), "
                             f"top_k={self.top_k} (>= 0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] fp32 -> the distribution the target samples from (temperature, then top-k, then top-p)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties by id, in any shape
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., V] (need not be normalized), uniform [...] in [0, 1) -> ids [...].

    All randomness enters as explicit uniforms, so one rank can draw them and broadcast them. Never returns an id
    of probability 0: a uniform that reaches 1.0 (a float64 draw rounded to float32) would land past the CDF, and
    is pulled back to the last id in the support.
    """
    cdf = probs.cumsum(-1)
    target = (uniform * cdf[..., -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    last = torch.arange(probs.shape[-1], device=probs.device).masked_fill(probs <= 0, -1).amax(-1)
    return torch.minimum(ids, last)


def sample(logits: torch.Tensor, params: SamplingParams, uniform: torch.Tensor | None) -> torch.Tensor:
    """logits: [B, V] fp32 -> token ids [B] (argmax when greedy, else an inverse-CDF draw with `uniform` [B])."""
    if params.greedy:
        return logits.argmax(-1)
    return sample_from(target_probs(logits, params), uniform)
