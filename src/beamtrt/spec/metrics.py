"""Speculative-decoding counters: acceptance length τ, per-position acceptance, and the histogram of τ.

τ of one verification step = the tokens that step committed: its accepted drafts plus the recovered/bonus token
(num_accepted + 1), or fewer when max tokens or a stop cut the step short. The reported acceptance length is the
mean over requests of each request's own τ (committed tokens ÷ verification steps), as z-lab's
`dflash/benchmark.py` reports it (dflash.md §2): a long request does not outweigh a short one. One difference: its
loop counts a request's last step whole (num_accepted + 1, also the tokens past max tokens or the stop that it
drops), so our τ is lower by at most (block_size - 1) ÷ steps per request (an audit measured 5.17 against 5.37 with
64 new tokens per request and a drafter proposing the right token in 80% of slots, block 16).

Example (block_size 4, so 3 draft slots):
    m = SpecMetrics(block_size=4)
    m.record_step("a", num_accepted=3, committed=4, num_drafted=3)   # all accepted + bonus
    m.record_step("a", num_accepted=1, committed=2, num_drafted=3)   # one accepted + recovered
    m.record_step("b", num_accepted=0, committed=1, num_drafted=3)
    m.acceptance_length("a") == 3.0; m.summary()["acceptance_length"] == (3.0 + 1.0) / 2 == 2.0
    m.summary()["per_position_acceptance"] == [2/3, 1/3, 1/3]; m.summary()["tau_histogram"] == [1, 1, 0, 1]
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass
class RequestCounts:
    steps: int = 0      # verification steps of this request
    committed: int = 0  # tokens those steps committed


@dataclass
class SpecMetrics:
    block_size: int  # anchor + drafts: τ is in 1..block_size, drafts per step in 0..block_size - 1
    steps: int = field(default=0, init=False)             # verification steps, all requests
    committed_tokens: int = field(default=0, init=False)  # tokens those steps committed
    proposed: list[int] = field(init=False)    # [block_size - 1] times draft slot k was verified
    accepted: list[int] = field(init=False)    # [block_size - 1] times draft slot k was accepted
    tau_counts: list[int] = field(init=False)  # [block_size] steps that committed τ = index + 1 tokens
    requests: dict[Hashable, RequestCounts] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self.proposed = [0] * (self.block_size - 1)
        self.accepted = [0] * (self.block_size - 1)
        self.tau_counts = [0] * self.block_size

    def record_step(self, request_id: Hashable, num_accepted: int, committed: int, num_drafted: int) -> None:
        """One verification step of one request: num_drafted drafts were verified, num_accepted of them accepted,
        and committed tokens (num_accepted + 1, or fewer if max tokens / a stop cut the step short) were kept."""
        num_accepted, committed, num_drafted = int(num_accepted), int(committed), int(num_drafted)
        if not 0 <= num_accepted <= num_drafted <= self.block_size - 1 or not 1 <= committed <= num_accepted + 1:
            raise ValueError(f"inconsistent step for request {request_id!r}: num_accepted={num_accepted}, "
                             f"committed={committed}, num_drafted={num_drafted}, block_size={self.block_size} "
                             f"(need 0 <= accepted <= drafted < block_size and 1 <= committed <= accepted + 1)")
        counts = self.requests.setdefault(request_id, RequestCounts())
        counts.steps += 1
        counts.committed += committed
        self.steps += 1
        self.committed_tokens += committed
        for k in range(num_drafted):
            self.proposed[k] += 1
            self.accepted[k] += k < num_accepted
        self.tau_counts[committed - 1] += 1

    def acceptance_length(self, request_id: Hashable) -> float:
        """τ of one request: its committed tokens ÷ its verification steps. KeyError if it has no step."""
        counts = self.requests[request_id]
        return counts.committed / counts.steps

    def summary(self) -> dict:
        """JSON-serializable totals. acceptance_length is None before any step; per_position_acceptance[k] is
        accepted ÷ proposed for draft slot k (unconditional: slot k is accepted only if slots < k were; as verified,
        a step cut by max_new_tokens or a stop counting whole), None for a slot never proposed; tau_histogram[i]
        counts the steps that committed i + 1 tokens."""
        taus = [self.acceptance_length(r) for r in self.requests]
        return {
            "acceptance_length": sum(taus) / len(taus) if taus else None,
            "per_position_acceptance": [a / p if p else None for a, p in zip(self.accepted, self.proposed)],
            "tau_histogram": list(self.tau_counts),
            "steps": self.steps,
            "committed_tokens": self.committed_tokens,
            "requests_with_steps": len(self.requests),  # those acceptance_length averages over
        }
