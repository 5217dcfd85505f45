"""The speculative decoding loop: prefill, then draft a block -> verify it in one target pass -> commit, per step.

One step for the active requests (ragged acceptance; shapes in comments):
  drafter.draft(anchors, slots, ...)     block drafts, then the selector walk over candidates [N, S, K] (S = block - 1):
                                         drafts [N, S] (+ the exact proposal q [N, S, K] when sampling)
  proposal_lengths                       with draft_threshold > 0: drafts proposed per request [N] (the rest cut)
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

from beamtrt.config import check_draft_threshold, drafter_block_error
from beamtrt.runtime.backend import DrafterBackend, DraftStep, TargetBackend
from beamtrt.spec.metrics import SpecMetrics
from beamtrt.spec.sampling import SamplingParams, sample, target_probs
from beamtrt.spec.stops import completed_by
from beamtrt.spec.streams import RequestStreams, request_seed
from beamtrt.spec.verify import verify_greedy, verify_sampled


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None     # of its own random stream when sampling (None: from the decoder's seed and its index)
    min_new_tokens: int = 0     # its stop tokens are not generated before it has this many new tokens


@dataclass
class Completion:
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""     # "stop" (stop token or string) or "length"
    steps: int = 0              # verification steps
    committed: int = 0          # tokens committed by verification steps (the token right after prefill excluded)
    accepted: int = 0           # of those, accepted drafts (a step cut short inside its drafts keeps drafts only)
    drafted: int = 0            # drafts those steps verified

    @property
    def acceptance_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0


@dataclass
class StepTimes:
    steps: int = 0              # batched steps (each verifies one block for every active request)
    target_s: float = 0.0
    drafter_s: float = 0.0
    total_s: float = 0.0
    # of those, seconds in collectives (tensor-parallel backends count theirs in `comm_s`; 0 in one process)
    target_comm_s: float = 0.0
    drafter_comm_s: float = 0.0
    comm_s: float = 0.0

    @property
    def other_s(self) -> float:
        return self.total_s - self.target_s - self.drafter_s


def proposal_lengths(proposal: DraftStep, threshold: float) -> torch.Tensor:
    """-> [N] long: how many drafts each request proposes, the longest prefix of slots whose running product of
    confidences (proposal.confidence [N, S]) stays >= threshold. A slot's confidence does not depend on its own draft
    (`selector.draft_confidence`), so the cut is made before each draft is drawn and sampling stays exact."""
    return (proposal.confidence.cumprod(-1) >= threshold).sum(-1)  # a prefix: the product never grows


def headroom(block_size: int) -> int:
    """Cache positions a request needs beyond its prompt and max_new_tokens at `block_size` (block_size 1: no drafter):
    the last step starts with max_new_tokens - 1 tokens made, its anchor (the last of them) at position prompt +
    max_new_tokens - 2, and writes the anchor and up to block_size - 1 drafts (a request fits a context of prompt +
    max_new_tokens + headroom; -1 without a drafter: the last token made is never written)."""
    return block_size - 2


def too_long(prompt_tokens: int, max_new_tokens: int, block_size: int, context: int | None,
             field: str = "max_new_tokens") -> str | None:
    """Why a request does not fit a target's `context` (its prompt, max_new_tokens and the positions of a last
    verify block), or None (also for a context of None: a backend without one); `field` is what the message calls
    max_new_tokens."""
    need = prompt_tokens + max_new_tokens + headroom(block_size)
    if context is None or need <= context:
        return None
    block = f" (verifying blocks of {block_size})" if block_size > 1 else ""
    return (f"its prompt ({prompt_tokens} tokens) and {field} {max_new_tokens} need {need} positions{block}, more "
            f"than the target's context of {context} tokens")


class SpeculativeDecoder:
    def __init__(self, target: TargetBackend, drafter: DrafterBackend | None = None, block_size: int = 8,
                 params: SamplingParams = SamplingParams(), seed: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None, draft_threshold: float = 0.0):
        """draft_threshold: verify only the drafts of a block whose running product of the drafter's confidences is
        >= it (`proposal_lengths`); 0 verifies the whole block. Fewer verified rows make a step cheaper where a
        verify's cost grows with its rows (an MoE target reads more experts), at the cost of some accepted drafts."""
        if drafter is not None and block_size < 2:
            raise ValueError(f"--block-size must be >= 2 with a drafter, got {block_size}")
        if drafter is not None and (why := drafter_block_error(block_size, drafter.block_size)):
            raise ValueError(why)
        check_draft_threshold(draft_threshold)
        self.target, self.drafter = target, drafter
        self.block_size = block_size if drafter is not None else 1
        self.draft_threshold = draft_threshold if drafter is not None else 0.0
        self.params = params
        self.seed = seed  # every random decision is drawn on rank 0, request i's from its own stream (streams.py):
        #                   seeded by request_seed(seed, i), or by the request's own seed
        self.detokenize = detokenize
        self.taps = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self.metrics = SpecMetrics(block_size=self.block_size)
        self.times = StepTimes()

    @property
    def headroom(self) -> int:
        return headroom(self.block_size)

    @torch.inference_mode()
    def generate(self, requests: Sequence[Request], on_tokens: Callable[[int, list[int]], None] | None = None,
                 concurrency: int | None = None,
                 on_finish: Callable[[int, Completion], None] | None = None) -> list[Completion]:
        """Serve every request until each hits a stop or its max_new_tokens, at most `concurrency` at a time
        (default: all at once, or as many as the target holds: a TensorRT engine's --max-batch-size). Continuous
        batching: a finished request's cache slot is refilled from the queue (prefilled) before the next step.
        on_tokens(request index, tokens) sees every committed token, on_finish(request index, completion) every
        request as it finishes."""
        n = len(requests)
        if n == 0:
            return []
        room = self.headroom
        for i, r in enumerate(requests):
            if not r.prompt_ids or r.max_new_tokens < 1:
                raise ValueError("every request needs a non-empty prompt and max_new_tokens >= 1")
            if not 0 <= r.min_new_tokens <= r.max_new_tokens:
                raise ValueError(f"request {i}: min_new_tokens must be in [0, max_new_tokens {r.max_new_tokens}], "
                                 f"got {r.min_new_tokens}")
            if why := self.too_long(r):
                raise ValueError(f"request {i}: {why}")
            if not 0 <= min(r.prompt_ids) <= max(r.prompt_ids) < self.target.vocab_size:
                bad = next(t for t in r.prompt_ids if not 0 <= t < self.target.vocab_size)
                raise ValueError(f"request {i}: its prompt holds token id {bad}, outside the target's vocabulary "
                                 f"[0, {self.target.vocab_size}) (a tokenizer of another model?)")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
        slots = min(concurrency or getattr(self.target, "max_batch_size", n), n)
        self.start(slots, max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + room, on_finish)
        done = [Completion() for _ in requests]
        queue = list(range(n))
        while True:
            free = [s for s in range(slots) if self.owner[s] < 0]
            if queue and free:
                admitted, queue = queue[:len(free)], queue[len(free):]
                self.admit(list(zip(free, admitted)), requests, done, on_tokens)
            active = [s for s in range(slots) if self.owner[s] >= 0]
            if not active:
                if not queue:
                    return done
                continue
            self.step(active, requests, done, on_tokens)

    def start(self, slots: int, max_len: int, on_finish: Callable[[int, Completion], None] | None = None) -> None:
        """(Re)allocate `slots` empty cache slots of up to `max_len` tokens: the state `admit`, `step` and `release`
        work on (`generate` calls it; a server calls it once, then admits and steps requests as they come)."""
        if self.drafter is not None:  # first: the old rings go before the target's KV cache is checked
            self.drafter.allocate(slots)
        self.target.allocate(slots, max_len)
        self.on_finish = on_finish
        self.owner = [-1] * slots  # request served by each cache slot (-1: free)
        self.streams = RequestStreams(slots)  # each slot's request's random stream (seeded at admission)
        self.anchor = torch.zeros(slots, dtype=torch.long)  # [slots] last committed token, not yet in the target KV
        self.position = torch.zeros(slots, dtype=torch.long)  # [slots] tokens in the target KV = the anchor's position

    def admit(self, admitted: list[tuple[int, int]], requests: Sequence[Request], done: Sequence[Completion],
              on_tokens: Callable[[int, list[int]], None] | None, params: SamplingParams | None = None) -> None:
        """Prefill new requests into free slots [(slot, request)]: the prompts in one ragged pass, whose taps become
        the drafter's context; then sample each request's first token (with `params`, default the decoder's)."""
        params = self.params if params is None else params
        slot_ids = [s for s, _ in admitted]
        slots = torch.tensor(slot_ids)
        self.target.reset(slot_ids)
        if self.drafter is not None:
            self.drafter.reset(slot_ids)
        for s, i in admitted:
            seed = requests[i].seed
            self.streams.start(s, request_seed(self.seed, i) if seed is None else seed)
        prompts = [requests[i].prompt_ids for _, i in admitted]
        lengths = torch.tensor([len(p) for p in prompts])
        width = int(lengths.max())
        ids = torch.tensor([p + (0,) * (width - len(p)) for p in prompts])  # [M, width] right-padded
        out = self.target.forward(ids, slots, lengths, taps=self.taps, last_only=True)
        self._hold_stops(out.logits[:, -1:], [i for _, i in admitted], requests, done)
        if self.drafter is not None:
            self.drafter.append_context(out.taps, slots, lengths)
        uniforms = None if params.greedy else self.streams.draw(slot_ids).to(out.logits.device)
        first = sample(out.logits[:, -1], params, uniforms).cpu()  # sampled where the logits are; M ids come back
        self.anchor[slots] = first
        self.position[slots] = lengths
        for (s, i), token in zip(admitted, first.tolist()):
            self.owner[s] = i
            self._commit(i, requests[i], done[i], [token], on_tokens)
            if done[i].finish_reason:
                self.release(s, done[i])

    def step(self, active: list[int], requests: Sequence[Request], done: Sequence[Completion],
             on_tokens: Callable[[int, list[int]], None] | None, params: SamplingParams | None = None) -> None:
        """One draft -> verify -> commit step for the active cache slots, sampling with `params` (default the
        decoder's); finished requests free their slot."""
        params = self.params if params is None else params
        start, comm0 = time.perf_counter(), self._comm_s()
        slots = torch.tensor(active)
        anchors = self.anchor[slots]  # [N]
        gamma = self.block_size - 1
        cand = q = None
        drafts = torch.zeros(len(active), 0, dtype=torch.long)  # [N, gamma]
        num_drafts = torch.full((len(active),), gamma)  # [N] drafts proposed per request
        if self.drafter is not None:
            uniforms = None if params.greedy else self.streams.draw(active, gamma)
            t, c = time.perf_counter(), self._comm_s()
            proposal = self.drafter.draft(anchors, self.block_size, slots, params, uniforms)
            self.times.drafter_s += time.perf_counter() - t
            self.times.drafter_comm_s += self._comm_s() - c
            drafts, cand, q = proposal.draft_ids, proposal.cand_ids, proposal.q
            if self.draft_threshold > 0:
                num_drafts = proposal_lengths(proposal, self.draft_threshold)
                width = int(num_drafts.max())  # one rectangle: shorter proposals are padded (their rows are dead)
                drafts, cand, q = drafts[:, :width], cand[:, :width], None if q is None else q[:, :width]
        t, c = time.perf_counter(), self._comm_s()
        block = torch.cat([anchors[:, None].to(drafts.device), drafts], dim=1)  # [N, 1 + drafts]
        out = self.target.forward(block, slots, num_drafts.cpu() + 1, taps=self.taps)
        self.times.target_s += time.perf_counter() - t
        self.times.target_comm_s += self._comm_s() - c
        self._hold_stops(out.logits, [self.owner[s] for s in active], requests, done)
        # Verify where the target left its logits (a GPU's: only the emitted ids come back to the host, never the
        # [N, 1 + drafts, V] logits); the drafter's outputs and the host's uniforms are small and move there.
        device = out.logits.device
        drafts, num_drafts = drafts.to(device), num_drafts.to(device)
        if params.greedy:
            result = verify_greedy(drafts, out.logits, num_drafts)
        else:  # γ accept uniforms whatever the cut: the random stream does not depend on the threshold
            u_accept = self.streams.draw(active, gamma)[:, :drafts.shape[1]]
            cand, q = (None if x is None else x.to(device) for x in (cand, q))
            result = verify_sampled(drafts, cand, q, target_probs(out.logits, params), u_accept.to(device),
                                    self.streams.draw(active).to(device), num_drafts)
        # one transfer: [N, γ' + 1] tokens, then num_accepted and num_drafts
        host = torch.cat([result.tokens, result.num_accepted[:, None], num_drafts[:, None]], dim=1).cpu()
        tokens, num_accepted, num_drafts = host[:, :-2], host[:, -2], host[:, -1]
        committed = num_accepted + 1  # [N]
        self.position[slots] += committed
        self.target.crop(slots, self.position[slots])
        self.anchor[slots] = tokens.gather(1, num_accepted[:, None]).squeeze(1)
        if self.drafter is not None:
            t, c = time.perf_counter(), self._comm_s()
            self.drafter.append_context(out.taps, slots, committed)
            if device.type == "cuda":  # its kernels are this step's work: timed here, not in the next (untimed) prefill
                torch.cuda.synchronize(device)
            self.times.drafter_s += time.perf_counter() - t
            self.times.drafter_comm_s += self._comm_s() - c
        for s, row, k, drafted in zip(active, tokens.tolist(), committed.tolist(), num_drafts.tolist()):
            i = self.owner[s]
            kept = self._commit(i, requests[i], done[i], row[:k], on_tokens)
            self.metrics.record_step(i, k - 1, kept, drafted)
            done[i].steps += 1
            done[i].committed += kept
            done[i].accepted += min(k - 1, kept)
            done[i].drafted += drafted
            if done[i].finish_reason:
                self.release(s, done[i])
        self.times.total_s += time.perf_counter() - start
        self.times.comm_s += self._comm_s() - comm0
        self.times.steps += 1

    @staticmethod
    def _hold_stops(logits: torch.Tensor, owners: list[int], requests: Sequence[Request],
                    done: Sequence[Completion]) -> None:
        """logits: [N, positions, V], row n for request owners[n], position j making its next token + j. A request
        short of its min_new_tokens cannot end there: its stop tokens are masked out of the positions before it (in
        place; plain and speculative decoding then sample the same distribution, and verification stays exact).
        One gather and one scatter over the union of the held requests' stop tokens, however many requests."""
        V = logits.shape[-1]
        short, held = [0] * len(owners), {}  # [N] positions still short of each minimum; row -> its stop tokens
        for row, i in enumerate(owners):
            need = requests[i].min_new_tokens - len(done[i].output_ids)
            stops = [t for t in requests[i].stop_token_ids if t < V] if need > 0 else []  # beyond V: never come
            if stops:
                short[row], held[row] = need, stops
        if not held:
            return
        union = sorted(set().union(*held.values()))
        member = torch.tensor([[t in held.get(row, ()) for t in union] for row in range(len(owners))])  # [N, U]
        hold = (torch.arange(logits.shape[1]) < torch.tensor(short)[:, None])[:, :, None] & member[:, None, :]
        ids = torch.tensor(union, device=logits.device)
        logits[:, :, ids] = logits[:, :, ids].masked_fill(hold.to(logits.device), float("-inf"))

    def _comm_s(self) -> float:
        """Seconds the backends have spent in collectives so far (tensor-parallel rank 0; 0 in one process)."""
        return getattr(self.target, "comm_s", 0.0) + (getattr(self.drafter, "comm_s", 0.0) if self.drafter else 0.0)

    def too_long(self, request: Request, field: str = "max_new_tokens") -> str | None:
        """Why `request` does not fit the target's context, or None (`too_long`)."""
        context = getattr(self.target, "max_seq_len", None)  # the target's context (None: a backend without one)
        return too_long(len(request.prompt_ids), request.max_new_tokens, self.block_size, context, field)

    def release(self, slot: int, completion: Completion) -> None:
        """A request finished (or was cancelled): free its slot (reset when the next request is prefilled into it)."""
        i, self.owner[slot] = self.owner[slot], -1
        if self.on_finish is not None:
            self.on_finish(i, completion)

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
        if request.stop_strings and self.detokenize is not None:  # one completed before the stop token ends first
            end = completed_by(self.detokenize, completion.output_ids, kept, request.stop_strings)
            if end is not None:
                kept = kept[:end]
                completion.finish_reason = "stop"
        completion.output_ids.extend(kept)
        if not completion.finish_reason and len(completion.output_ids) >= request.max_new_tokens:
            completion.finish_reason = "length"
        if on_tokens is not None and kept:
            on_tokens(i, kept)
        return len(kept)
