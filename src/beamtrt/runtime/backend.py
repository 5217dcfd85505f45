"""The backend interface the speculative loop drives: a target that verifies blocks and a drafter that drafts them.

Acceptance, sampling and bookkeeping stay in `beamtrt.spec`; a backend only runs networks and owns their caches,
so every backend (torch today, TensorRT engines later) inherits the same exactness argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class TargetStep:
    logits: torch.Tensor        # [N, T, V] fp32 (T = 1 when only the last row was asked for)
    taps: torch.Tensor | None   # [N, T, n_taps * H] residual stream after the tapped layers, or None


class TargetBackend(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def allocate(self, slots: int, max_len: int) -> None:
        """(Re)create the KV cache for `slots` sequences of up to `max_len` tokens each."""

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor | None = None,
                taps: tuple[int, ...] = (), last_only: bool = False) -> TargetStep:
        """Append ids [N, T] (right-padded; num_tokens [N]) to the given cache slots [N]; logits and taps."""

    def crop(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll the given slots back to `lengths` tokens (the rejected rows of a verified block)."""

    def reset(self, slots: list[int]) -> None:
        """Empty slots for new requests."""


@dataclass
class DraftStep:
    cand_ids: torch.Tensor      # [N, S, K] candidate ids per draft slot (S = block - 1)
    scores: torch.Tensor        # [N, S, K, K] fp32 selector scores: [n, t, i, j] = candidate j after candidate i


class DrafterBackend(Protocol):
    target_layer_ids: tuple[int, ...]

    def allocate(self, slots: int) -> None:
        """(Re)create the context cache for `slots` sequences."""

    def append_context(self, taps: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Append committed tokens' taps [slots, T, n_taps * H] (right-padded; num_tokens [slots]) to every slot."""

    def draft(self, anchor_ids: torch.Tensor, block_size: int, slots: torch.Tensor) -> DraftStep:
        """Draft a block after each anchor [N] (the last committed token of cache slot slots[n], not yet in the
        context); only those slots are computed."""

    def reset(self, slots: list[int]) -> None:
        """Empty slots for new requests."""
