"""The `torch` backend: the reference Beam target and DFlash2 drafter behind the backend interface."""

from __future__ import annotations

import torch

from beamtrt.models.beam import BeamForCausalLM, KVCache, check_cache_fits
from beamtrt.models.dflash2 import DraftCache
from beamtrt.native.kernels import kernels_for
from beamtrt.runtime.backend import DraftStep, TargetStep
from beamtrt.spec.sampling import SamplingParams
from beamtrt.spec.selector import draft_confidence, greedy_q, walk_greedy, walk_sampled


class TorchTarget:
    def __init__(self, model: BeamForCausalLM):
        self.model = model
        self.vocab_size = model.shard.vocab_size if model.shard is not None else model.cfg.vocab_size
        self.eos_token_ids = model.cfg.eos_token_ids
        self.max_seq_len = model.cfg.max_position_embeddings  # prompt + new tokens of one request
        self.cache: KVCache | None = None

    def allocate(self, slots: int, max_len: int) -> None:
        self.cache = None  # the old cache's memory is free for the new one
        check_cache_fits(f"KV cache of {slots} requests x {max_len} positions", KVCache.shape(self.model.cfg, slots,
                         max_len), self.model.dtype, self.model.device, self.model.shard)
        self.cache = self.model.new_cache(slots, max_len)

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor | None = None,
                taps: tuple[int, ...] = (), last_only: bool = False) -> TargetStep:
        device = self.model.device
        every = len(slots) == self.cache.batch and bool((slots == torch.arange(len(slots))).all())
        out = self.model(ids.to(device), self.cache, None if num_tokens is None else num_tokens.to(device),
                         taps=taps, last_only=last_only, slots=None if every else slots.to(device))
        tapped = torch.cat(out.taps, dim=-1) if taps else None  # both stay on the model's device
        return TargetStep(out.logits, tapped)

    def crop(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        device = self.model.device
        self.cache.crop(lengths.to(device), slots.to(device))

    def reset(self, slots: list[int]) -> None:
        self.cache.reset(slots)


class TorchDrafter:
    def __init__(self, drafter):  # a beamtrt.models.dflash2.DFlash2Drafter
        self.drafter = drafter
        self.target_layer_ids = tuple(drafter.cfg.target_layer_ids)
        self.block_size = drafter.cfg.block_size  # the block it was trained on: the largest it drafts
        self.cache = None
        if drafter.candidate_selector.shard is None:  # vocab-parallel codebooks keep the reference path
            drafter.kernels = kernels_for(drafter.device, drafter.cfg)

    def allocate(self, slots: int) -> None:
        self.cache = None
        cfg = self.drafter.cfg
        check_cache_fits(f"drafter's context cache of {slots} requests x {cfg.sliding_window} positions",
                         DraftCache.shape(cfg, slots), self.drafter.dtype, self.drafter.device,
                         self.drafter.target.shard)
        self.cache = self.drafter.new_cache(slots)

    def append_context(self, taps: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        device = self.drafter.device
        rows = slots.to(device)
        full = torch.zeros(self.cache.batch, *taps.shape[1:], dtype=self.drafter.dtype, device=device)  # every slot
        full[rows] = taps.to(device, self.drafter.dtype)
        counts = torch.zeros(self.cache.batch, dtype=torch.long, device=device)
        counts[rows] = num_tokens.to(device)
        self.drafter.append_context(self.cache, full, counts)

    @torch.inference_mode()
    def draft(self, anchor_ids: torch.Tensor, block_size: int, slots: torch.Tensor, params: SamplingParams,
              uniforms: torch.Tensor | None) -> DraftStep:
        device, kernels = self.drafter.device, self.drafter.kernels
        every = len(slots) == self.cache.batch and bool((slots == torch.arange(len(slots))).all())
        out = self.drafter.draft(self.cache, anchor_ids.to(device), block_size, None if every else slots.to(device),
                                 lattice=kernels is None)
        if kernels is None:  # the reference walk over the lattice the drafter scored
            cand, scores = out.cand_ids.cpu(), out.scores.float().cpu()
            if params.greedy:
                drafts, chosen = walk_greedy(cand, scores)
                return DraftStep(drafts, cand, None, draft_confidence(greedy_q(scores, chosen)))
            drafts, q = walk_sampled(cand, scores, params.temperature, params.top_p, uniforms)
            return DraftStep(drafts, cand, q, draft_confidence(q))
        # the plugin kernel: top-K, edge scores and the walk in one launch (plugins/block_selector)
        N, S = out.logits.shape[:2]
        selector = self.drafter.candidate_selector
        temperature = torch.full((N,), params.temperature, device=device)
        top_p = torch.full((N,), params.top_p, device=device)
        uniforms = torch.zeros(N, S) if uniforms is None else uniforms
        top_k = min(self.drafter.cfg.selector_top_k, out.logits.shape[-1])
        drafts, cand, q = kernels.block_selector(
            out.logits.contiguous(), selector.hidden_projection(out.hidden).float().contiguous(),
            anchor_ids.to(device, torch.int32), selector.predecessor_codebook.detach(),
            selector.successor_codebook.detach(), temperature, top_p, uniforms.to(device), top_k=top_k)
        # on the device, where the decoder verifies; greedy requests' q: the temperature-1 rows, for the confidence
        return DraftStep(drafts.long(), cand.long(), None if params.greedy else q, draft_confidence(q))

    def reset(self, slots: list[int]) -> None:
        self.drafter.reset(self.cache, slots)
