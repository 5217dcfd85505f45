"""The speculative decoding loop: prefill, then draft a block -> verify it in one target pass -> commit, per step.

One step for the active requests (ragged acceptance; shapes in comments):
  drafter.draft(anchors, slots)          candidates [N, S, K] and selector scores [N, S, K, K], S = block - 1
  selector walk                          drafts [N, S] (+ the exact proposal q [N, S, K] when sampling)
  target.forward([anchor, drafts])       logits [N, S + 1, V], taps [N, S + 1, n_taps * H]
  verify                                 accepted drafts + one recovered or bonus token per request
  commit                                 crop the target KV to the committed tokens; their taps -> drafter context
Without a drafter (`--no-spec`) the same step verifies a block of just the anchor, i.e. plain decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from beamtrt.runtime.backend import DrafterBackend, TargetBackend
from beamtrt.spec.metrics import SpecMetrics
from beamtrt.spec.sampling import SamplingParams, sample, target_probs
from beamtrt.spec.selector import walk_greedy, walk_sampled
from beamtrt.spec.verify import verify_greedy, verify_sampled


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()


@dataclass
class Completion:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""     # "stop" (stop token or string) or "length"
    steps: int = 0              # verification steps
    committed: int = 0          # tokens committed by verification steps (the token right after prefill excluded)

    @property
    def acceptance_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0


@dataclass
class StepTimes:
    steps: int = 0              # batched steps (each verifies one block for every active request)
    target_s: float = 0.0
    drafter_s: float = 0.0
    total_s: float = 0.0

    @property
    def other_s(self) -> float:
        return self.total_s - self.target_s - self.drafter_s


class SpeculativeDecoder:
    def __init__(self, target: TargetBackend, drafter: DrafterBackend | None = None, block_size: int = 8,
                 params: SamplingParams = SamplingParams(), seed: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None):
        if drafter is not None and block_size < 2:
            raise ValueError(f"--block-size must be >= 2 with a drafter, got {block_size}")
        self.target, self.drafter = target, drafter
        self.block_size = block_size if drafter is not None else 1
        self.params = params
        self.generator = torch.Generator().manual_seed(seed)  # every random decision is drawn here (rank 0)
        self.detokenize = detokenize
        self.taps = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self.metrics = SpecMetrics(block_size=self.block_size)
        self.times = StepTimes()

    def _uniforms(self, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator)

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request],
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Completion]:
        """Serve every request in one batch until each hits a stop or its max_new_tokens."""
        n = len(requests)
        if n == 0:
            return []
        for r in requests:
            if not r.prompt_ids or r.max_new_tokens < 1:
                raise ValueError("every request needs a non-empty prompt and max_new_tokens >= 1")
        lengths = torch.tensor([len(r.prompt_ids) for r in requests])
        max_len = int(lengths.max()) + max(r.max_new_tokens for r in requests) + self.block_size + 1
        self.target.allocate(n, max_len)
        if self.drafter is not None:
            self.drafter.allocate(n)
        done = [Completion() for _ in requests]

        # prefill: the whole prompt in one ragged pass; its taps become the drafter's context
        width = int(lengths.max())
        ids = torch.tensor([r.prompt_ids + (0,) * (width - len(r.prompt_ids)) for r in requests])  # right-padded
        out = self.target.forward(ids, torch.arange(n), lengths, taps=self.taps, last_only=True)
        if self.drafter is not None:
            self.drafter.append_context(out.taps, lengths)
        first = sample(out.logits[:, -1], self.params, None if self.params.greedy else self._uniforms(n))
        self.anchor = first.clone()  # [n] last committed token of each slot, not yet in the target KV
        self.position = lengths.clone()  # [n] tokens in the target KV = the anchor's position
        for i in range(n):
            self._commit(i, requests[i], done[i], [int(first[i])], on_tokens)
        active = [i for i in range(n) if not done[i].finish_reason]
        while active:
            active = self.step(active, requests, done, on_tokens)
        return done

    def step(self, active: list[int], requests: Sequence[Request], done: list[Completion],
             on_tokens: Callable[[int, list[int]], None] | None) -> list[int]:
        """One draft -> verify -> commit step for the active slots; returns the slots still running."""
        start = time.perf_counter()
        slots = torch.tensor(active)
        anchors = self.anchor[slots]  # [N]
        gamma = self.block_size - 1
        cand = q = None
        drafts = torch.zeros(len(active), 0, dtype=torch.long)  # [N, gamma]
        if self.drafter is not None:
            t = time.perf_counter()
            proposal = self.drafter.draft(anchors, self.block_size, slots)
            self.times.drafter_s += time.perf_counter() - t
            cand, scores = proposal.cand_ids, proposal.scores
            if self.params.greedy:
                drafts, _ = walk_greedy(cand, scores)
            else:
                drafts, q = walk_sampled(cand, scores, self.params.temperature, self.params.top_p,
                                         self._uniforms(len(active), gamma))
        t = time.perf_counter()
        out = self.target.forward(torch.cat([anchors[:, None], drafts], dim=1), slots, taps=self.taps)
        self.times.target_s += time.perf_counter() - t
        if self.params.greedy:
            result = verify_greedy(drafts, out.logits)
        else:
            result = verify_sampled(drafts, cand, q, target_probs(out.logits, self.params),
                                    self._uniforms(len(active), gamma), self._uniforms(len(active)))
        committed = result.num_accepted + 1  # [N]
        self.position[slots] += committed
        self.target.crop(slots, self.position[slots])
        self.anchor[slots] = result.tokens.gather(1, result.num_accepted[:, None]).squeeze(1)
        if self.drafter is not None:
            t = time.perf_counter()
            taps = out.taps.new_zeros(len(self.anchor), *out.taps.shape[1:])
            taps[slots] = out.taps
            counts = torch.zeros(len(self.anchor), dtype=torch.long)
            counts[slots] = committed
            self.drafter.append_context(taps, counts)
            self.times.drafter_s += time.perf_counter() - t
        still = []
        for i, row, k in zip(active, result.tokens.tolist(), committed.tolist()):
            kept = self._commit(i, requests[i], done[i], row[:k], on_tokens)
            self.metrics.record_step(i, k - 1, kept, gamma)
            done[i].steps += 1
            done[i].committed += kept
            if not done[i].finish_reason:
                still.append(i)
        self.times.total_s += time.perf_counter() - start
        self.times.steps += 1
        return still

    def _commit(self, i: int, request: Request, completion: Completion, tokens: list[int],
                on_tokens: Callable[[int, list[int]], None] | None) -> int:
        """Append a step's tokens to request i, cut at a stop or the token budget (then finish_reason is set).

        Returns how many tokens were kept.
        """
        budget = request.max_new_tokens - len(completion.output_ids)
        kept = tokens[:budget]
        for j, token in enumerate(kept):
            if token in request.stop_token_ids:
                kept = kept[:j + 1]
                completion.finish_reason = "stop"
                break
        if request.stop_strings and self.detokenize is not None and not completion.finish_reason:
            end = self._stop_string_end(completion.output_ids, kept, request.stop_strings)
            if end is not None:
                kept = kept[:end]
                completion.finish_reason = "stop"
        completion.output_ids.extend(kept)
        if not completion.finish_reason and len(completion.output_ids) >= request.max_new_tokens:
            completion.finish_reason = "length"
        if on_tokens is not None and kept:
            on_tokens(i, kept)
        return len(kept)

    def _stop_string_end(self, before: list[int], new: list[int], stops: tuple[str, ...]) -> int | None:
        """How many of `new` to keep when they complete a stop string (up to the completing token), else None."""
        def stopped(ids: list[int]) -> bool:
            text = self.detokenize(ids)
            return any(s in text for s in stops)

        if not stopped(before + new):
            return None
        return next(j for j in range(1, len(new) + 1) if stopped(before + new[:j]))
