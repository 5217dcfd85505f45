"""The `torch` backend: the reference Beam target and DFlash2 drafter behind the backend interface."""

from __future__ import annotations

import torch

from beamtrt.models.beam import BeamForCausalLM, KVCache
from beamtrt.runtime.backend import DraftStep, TargetStep


class TorchTarget:
    def __init__(self, model: BeamForCausalLM):
        self.model = model
        self.vocab_size = model.shard.vocab_size if model.shard is not None else model.cfg.vocab_size
        eos = model.cfg.eos_token_id
        self.eos_token_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        self.cache: KVCache | None = None

    def allocate(self, slots: int, max_len: int) -> None:
        self.cache = self.model.new_cache(slots, max_len)

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor | None = None,
                taps: tuple[int, ...] = (), last_only: bool = False) -> TargetStep:
        device = self.model.device
        every = len(slots) == self.cache.batch and bool((slots == torch.arange(len(slots))).all())
        out = self.model(ids.to(device), self.cache, None if num_tokens is None else num_tokens.to(device),
                         taps=taps, last_only=last_only, slots=None if every else slots.to(device))
        tapped = torch.cat(out.taps, dim=-1).cpu() if taps else None
        return TargetStep(out.logits.cpu(), tapped)

    def crop(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        device = self.model.device
        self.cache.crop(lengths.to(device), slots.to(device))

    def reset(self, slots: list[int]) -> None:
        self.cache.reset(slots)


class TorchDrafter:
    def __init__(self, drafter):  # a beamtrt.models.dflash2.DFlash2Drafter
        self.drafter = drafter
        self.target_layer_ids = tuple(drafter.cfg.target_layer_ids)
        self.cache = None

    def allocate(self, slots: int) -> None:
        self.cache = self.drafter.new_cache(slots)

    def append_context(self, taps: torch.Tensor, num_tokens: torch.Tensor) -> None:
        device = self.drafter.device
        self.drafter.append_context(self.cache, taps.to(device, self.drafter.dtype), num_tokens.to(device))

    def draft(self, anchor_ids: torch.Tensor, block_size: int, slots: torch.Tensor) -> DraftStep:
        device = self.drafter.device
        every = len(slots) == self.cache.batch and bool((slots == torch.arange(len(slots))).all())
        out = self.drafter.draft(self.cache, anchor_ids.to(device), block_size, None if every else slots.to(device))
        return DraftStep(out.cand_ids.cpu(), out.scores.float().cpu())

    def reset(self, slots: list[int]) -> None:
        self.drafter.reset(self.cache, slots)
