"""Plain greedy decoding on the reference target, independent of the speculative loop (the reference it is tested against)."""

from __future__ import annotations

from typing import Sequence

import torch

from beamtrt.models.beam import BeamForCausalLM, right_padded


@torch.inference_mode()
def generate(model: BeamForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             eos_ids: Sequence[int] = ()) -> list[list[int]]:
    """Greedy tokens for every prompt in one batch: ragged prefill, then one token per step; a row stops at an EOS
    id (kept in its output) or max_new_tokens."""
    B, device = len(prompts), model.device
    ids, lengths = right_padded(prompts, device)
    cache = model.new_cache(B, int(lengths.max()) + max_new_tokens)
    logits = model(ids, cache, num_tokens=lengths, last_only=True).logits[:, -1]
    eos = torch.tensor(list(eos_ids), device=device)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        token = logits.argmax(-1)
        for b in (~done).nonzero().flatten().tolist():
            out[b].append(int(token[b]))
        done |= torch.isin(token, eos)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(token[:, None], cache).logits[:, -1]
    return out
