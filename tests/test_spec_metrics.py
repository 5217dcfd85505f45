"""SpecMetrics: per-request τ, the mean over requests, per-position acceptance, the τ histogram, JSON."""

from __future__ import annotations

import json

import pytest
import torch

from beamtrt.spec.metrics import SpecMetrics

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run best on one thread


def test_docstring_example():
    m = SpecMetrics(block_size=4)
    m.record_step("a", num_accepted=3, committed=4, num_drafted=3)
    m.record_step("a", num_accepted=1, committed=2, num_drafted=3)
    m.record_step("b", num_accepted=0, committed=1, num_drafted=3)
    assert m.acceptance_length("a") == 3.0 and m.acceptance_length("b") == 1.0
    s = m.summary()
    assert s["acceptance_length"] == 2.0
    assert s["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert s["tau_histogram"] == [1, 1, 0, 1]
    assert s["steps"] == 3 and s["committed_tokens"] == 7 and s["requests_with_steps"] == 2


def test_mean_is_over_requests_not_steps():
    """A long request with τ = 8 and a short one with τ = 1: mean over requests 4.5, pooled over steps ~7.4."""
    m = SpecMetrics(block_size=8)
    for _ in range(20):
        m.record_step(0, num_accepted=7, committed=8, num_drafted=7)
    m.record_step(1, num_accepted=0, committed=1, num_drafted=7)
    assert m.summary()["acceptance_length"] == 4.5
    assert m.summary()["committed_tokens"] / m.summary()["steps"] == pytest.approx(161 / 21)


def test_per_position_acceptance_counts_only_proposed_slots():
    m = SpecMetrics(block_size=5)
    m.record_step("r", num_accepted=2, committed=3, num_drafted=4)
    m.record_step("r", num_accepted=1, committed=2, num_drafted=2)  # shorter block near max tokens: slots 2, 3 idle
    m.record_step("s", num_accepted=4, committed=5, num_drafted=4)
    assert m.proposed == [3, 3, 2, 2] and m.accepted == [3, 2, 1, 1]
    assert m.summary()["per_position_acceptance"] == [1.0, 2 / 3, 0.5, 0.5]
    assert SpecMetrics(block_size=3).summary()["per_position_acceptance"] == [None, None]


def test_cut_short_steps_count_committed_tokens():
    """A stop at the 2nd of 4 emitted tokens commits 2: τ, totals and histogram use 2, acceptance still uses 3."""
    m = SpecMetrics(block_size=4)
    m.record_step("r", num_accepted=3, committed=2, num_drafted=3)
    m.record_step("r", num_accepted=0, committed=1, num_drafted=3)
    assert m.acceptance_length("r") == 1.5
    s = m.summary()
    assert s["committed_tokens"] == 3 and s["tau_histogram"] == [1, 1, 0, 0]
    assert s["per_position_acceptance"] == [0.5, 0.5, 0.5]


def test_histogram_covers_one_to_block_size():
    m = SpecMetrics(block_size=8)
    for tau in range(1, 9):
        for _ in range(tau):
            m.record_step(tau, num_accepted=tau - 1, committed=tau, num_drafted=7)
    assert m.summary()["tau_histogram"] == list(range(1, 9))
    assert m.summary()["acceptance_length"] == pytest.approx(4.5)


@pytest.mark.parametrize(("num_accepted", "committed", "num_drafted"),
                         [(2, 4, 3), (0, 0, 3), (4, 5, 3), (-1, 1, 3), (3, 4, 8)])
def test_inconsistent_steps_raise(num_accepted, committed, num_drafted):
    m = SpecMetrics(block_size=8)
    with pytest.raises(ValueError, match="inconsistent step"):
        m.record_step("r", num_accepted=num_accepted, committed=committed, num_drafted=num_drafted)
    assert m.steps == 0 and not m.requests


def test_unknown_request_and_empty_summary():
    m = SpecMetrics(block_size=4)
    with pytest.raises(KeyError):
        m.acceptance_length("nobody")
    assert m.summary() == {"acceptance_length": None, "per_position_acceptance": [None, None, None],
                           "tau_histogram": [0, 0, 0, 0], "steps": 0, "committed_tokens": 0, "requests_with_steps": 0}
    with pytest.raises(ValueError):
        SpecMetrics(block_size=0)


def test_summary_json_round_trip_with_tensor_inputs():
    """Counts taken straight from VerifyResult tensors are stored as ints, so the summary stays JSON-clean."""
    m = SpecMetrics(block_size=8)
    num_accepted = torch.tensor([7, 3, 0, 5])
    for r, a in enumerate(num_accepted):
        m.record_step(f"req{r % 2}", num_accepted=a, committed=a + 1, num_drafted=7)
    s = m.summary()
    text = json.dumps(s, allow_nan=False)
    assert json.loads(text) == s
    assert all(type(v) is int for v in s["tau_histogram"]) and type(s["committed_tokens"]) is int
    assert s["acceptance_length"] == (8 + 1 + 4 + 6) / 4 == ((8 + 1) / 2 + (4 + 6) / 2) / 2
