"""Plain (non-speculative) batched generation on the reference target: ragged prefill, then one token per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from beamtrt.models.beam import BeamForCausalLM


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 = no top-k cut

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"bad sampling settings: temperature={self.temperature} (>= 0), "
                             f"top_p={self.top_p} (in (0, 1]), top_k={self.top_k} (>= 0)")


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] fp32 -> the distribution the target samples from (temperature, top-k, top-p)."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, V] fp32 -> token ids [B]."""
    if params.temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(target_probs(logits, params), 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model: BeamForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             params: SamplingParams = SamplingParams(), eos_ids: Sequence[int] = (),
             generator: torch.Generator | None = None,
             on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Generate for every prompt in one batch; a row stops at an EOS id (kept in its output) or max_new_tokens."""
    B, device = len(prompts), model.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(B, int(lengths.max()), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p, device=device)
    cache = model.new_cache(B, int(lengths.max()) + max_new_tokens)
    logits = model(ids, cache, num_tokens=lengths, last_only=True).logits[:, -1]
    eos = torch.tensor(list(eos_ids), device=device)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token = sample(logits, params, generator)
        for b in (~done).nonzero().flatten().tolist():
            out[b].append(int(token[b]))
            if on_token is not None:
                on_token(b, int(token[b]))
        done |= torch.isin(token, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(token[:, None], cache).logits[:, -1]
    return out
