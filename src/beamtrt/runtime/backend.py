"""The backend interface the speculative loop drives: a target that verifies blocks and a drafter that drafts them.

Acceptance, sampling and bookkeeping stay in `beamtrt.spec`; a backend only runs networks and owns their caches,
so every backend (torch, and the TensorRT engines' trt backend) inherits the same exactness argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from beamtrt.spec.sampling import SamplingParams


@dataclass
class TargetStep:
    """A target pass's outputs, on the backend's device: the decoder verifies there and brings back only the
    emitted ids (a few bytes a request), never the logits."""
    logits: torch.Tensor        # [N, T, V] fp32 (T = 1 when only the last row was asked for)
    taps: torch.Tensor | None   # [N, T, n_taps * H] residual stream after the tapped layers, or None


class TargetBackend(Protocol):
    vocab_size: int
    max_seq_len: int  # the longest request, prompt + new tokens
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
    """A drafter's proposal, on its device or the host (the decoder moves it to the target's logits)."""
    draft_ids: torch.Tensor     # [N, S] long, the walked drafts (S = block - 1)
    cand_ids: torch.Tensor      # [N, S, K] long, the candidates of each draft slot
    q: torch.Tensor | None      # [N, S, K] fp32, the exact row each draft was drawn from; None for a greedy walk
    confidence: torch.Tensor    # [N, S] fp32, the walk's confidence per slot (`spec.selector.draft_confidence`)


class DrafterBackend(Protocol):
    target_layer_ids: tuple[int, ...]
    block_size: int  # the largest block it drafts (a drafter's training block; an engine's built block)

    def allocate(self, slots: int) -> None:
        """(Re)create the context cache for `slots` sequences."""

    def append_context(self, taps: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Append committed tokens' taps [N, T, n_taps * H] (right-padded, on the target's device; num_tokens [N]) to
        cache slots [N]. Under tensor parallelism every rank passes the taps of its own target pass."""

    def draft(self, anchor_ids: torch.Tensor, block_size: int, slots: torch.Tensor, params: SamplingParams,
              uniforms: torch.Tensor | None) -> DraftStep:
        """Draft a block after each anchor [N] (the last committed token of cache slot slots[n], not yet in the
        context) and walk the selector lattice: greedy, or sampled with `params` and one uniform per slot
        (uniforms [N, S]); only those slots are computed. The walk is `beamtrt.spec.selector`'s, bit for bit in its
        integer outputs, wherever it runs (PyTorch, the plugin kernels, a TensorRT engine)."""

    def reset(self, slots: list[int]) -> None:
        """Empty slots for new requests."""
