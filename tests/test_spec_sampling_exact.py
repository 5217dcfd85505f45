"""Sampling exactness end to end: the speculative decoder's first 3 emitted tokens follow the target's joint law.

A tiny Beam target (V = 8 tokens) and a tiny random DFlash 2 drafter (top-4 candidates, selector walk with a q that
is neither one-hot nor the target's p) run the real `SpeculativeDecoder` loop -- prefill, draft, sampled selector
walk, verify pass, `verify_sampled`, KV crop and drafter-context commit -- over many copies of one prompt. Each row
is an independent draw of (x1, x2, x3): x1 comes from the prefill, x2 from slot 0 of the first verify step, x3 from
slot 1 of that step (after an accepted x2) or slot 0 of a second step (after a rejection); the bonus token of a fully
accepted block would be x4, which max_new_tokens cuts (tests/test_spec_verify.py covers the bonus law). The joint over
the V^3 outcomes is compared with the exactly enumerated p(x1) p(x2 | x1) p(x3 | x1, x2), computed by the target's
own full-sequence forward of prompt + each of the V^2 prefixes (same temperature and top-p).

Statistic: TV(empirical, exact) over the V^3 cells, with the limit of tests/test_spec_verify.py:
    limit = sum_c sqrt(p_c (1 - p_c)) / (2 sqrt(n)) + sqrt(ln(1 / ALPHA) / (2 n))
(Jensen bounds E[TV] by the first term; one sample moves TV by at most 1/n, so McDiarmid gives the second as the
tail with probability ALPHA). Sensitivity: if the sampler's law is at TV 0.01 from the exact one, E[TV(empirical,
exact)] >= 0.01 (TV is convex), and McDiarmid's lower tail keeps the statistic above 0.01 - sqrt(ln(1 / BETA) / (2 n))
with probability >= 1 - BETA. The sample counts are chosen so that this is above the limit: every 1% TV bias fails
with probability >= 1 - BETA, while the exact sampler passes with probability >= 1 - ALPHA (all runs are seeded, so
the outcome is deterministic). A chi-square test over the cells (small ones pooled) rides along, and any outcome of
exact probability 0 (e.g. a token cut by top-p) fails outright.

Mutant verifiers (accept with 1.5 q, residual replaced by p, residual drawn as if normalized) run through the same
pipeline and the same check, and must fail it. The same check covers proposals cut by a draft threshold.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from beamtrt.config import BeamConfig, DrafterConfig
from beamtrt.models.beam import BeamForCausalLM, load_state
from beamtrt.models.dflash2 import random_drafter
from beamtrt.models.random_beam import random_tensors
from beamtrt.runtime.torch_backend import TorchDrafter, TorchTarget
from beamtrt.spec import verify as verify_mod
from beamtrt.spec.decoder import Request, SpeculativeDecoder
from beamtrt.spec.sampling import SamplingParams, target_probs
from beamtrt.spec.selector import draft_probs
from spec_stats import ALPHA, MUTANTS, law_stats, tv_limit

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run best on one thread

V, K = 8, 4                 # vocabulary, selector candidates per slot (K < V: the rest only comes from the residual)
PROMPT = (1, 5, 2)
NEW = 3                     # emitted tokens per row: the joint is over V^3 = 512 outcomes
BLOCK = 3                   # anchor + 2 draft slots: x3 may come from slot 1 of the first step
TOP_P = 0.99
BETA = 1e-2                 # miss probability allowed for any sampler at TV 0.01 from the exact law
BIAS = 0.01                 # the total-variation bias the test must catch
BATCH = 225_000             # rows per generate call (about 2 GB peak); calls differ by seed
SAMPLES = {0.7: 450_000, 1.0: 675_000}   # rows per temperature: limit + power margin <= BIAS needs 412k, 653k
MUTANT_SAMPLES = 30_000     # the mutants' biases are far larger than 1%: fewer rows already fail them

CFG = BeamConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=8, intermediate_size=32, moe_intermediate_size=16, num_experts=2, num_experts_per_tok=1,
                 max_position_embeddings=64)


@pytest.fixture(scope="module")
def target() -> BeamForCausalLM:
    model = BeamForCausalLM(CFG)
    load_state(model, random_tensors(CFG, seed=2, dtype=torch.float32, std=0.6))  # peaked, context-dependent p
    return model.eval()


@pytest.fixture(scope="module")
def drafter(target):
    cfg = DrafterConfig.for_target(CFG, num_hidden_layers=1, sliding_window=8, selector_top_k=K, selector_rank=8)
    return random_drafter(cfg, target, seed=1, std=0.3, conv_std=0.05, codebook_std=0.5)


# ---- the exact law --------------------------------------------------------------------------------------------

def prefixes() -> torch.Tensor:
    """[V^2, 2] every (x1, x2), row x1 * V + x2."""
    return torch.cartesian_prod(torch.arange(V), torch.arange(V))


def target_rows(target: BeamForCausalLM, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (logits, p), each [V^2, 3, V]: for prefix row x1 * V + x2 the rows predicting x1, x2 | x1, x3 | x1, x2.

    One full-sequence forward of prompt + prefix per row, in a fresh cache (no speculative code involved).
    """
    ids = torch.cat([torch.tensor(PROMPT).expand(V * V, len(PROMPT)), prefixes()], dim=1)
    logits = target(ids, target.new_cache(V * V, ids.shape[1])).logits[:, len(PROMPT) - 1:]
    return logits, target_probs(logits, params)


def exact_joint(target: BeamForCausalLM, params: SamplingParams) -> torch.Tensor:
    """[V^3] float64: p(x1) p(x2 | x1) p(x3 | x1, x2) at cell x1 * V^2 + x2 * V + x3."""
    _, p = target_rows(target, params)
    p, pre = p.double(), prefixes()
    first = p[:, 0].gather(1, pre[:, :1])   # p(x1); row 0 of every prefix is the same prompt-only row
    second = p[:, 1].gather(1, pre[:, 1:])  # p(x2 | x1)
    return (first * second * p[:, 2]).reshape(-1)


def top_p_margin(logits: torch.Tensor, params: SamplingParams) -> float:
    """How far every row's top-p cut is from flipping: min |mass before a token - top_p| over all tokens.

    The decoder computes the same rows through a different path (KV cache, batched verify); round-off there must not
    move a token across the cut, or the reference would not be the law being sampled."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    sorted_p, _ = torch.sort(probs, dim=-1, descending=True)
    return float(((sorted_p.cumsum(-1) - sorted_p) - params.top_p).abs().min())


@pytest.fixture(scope="module", params=sorted(SAMPLES), ids=lambda t: f"T{t}")
def case(request, target):
    params = SamplingParams(temperature=request.param, top_p=TOP_P)
    logits, _ = target_rows(target, params)
    assert top_p_margin(logits, params) > 1e-5  # fp32 round-off is ~1e-7
    return params, exact_joint(target, params)


# ---- the statistic ----------------------------------------------------------------------------------------------

def power_margin(n: int) -> float:
    """A sampler at TV BIAS from the exact law shows TV >= BIAS - power_margin(n) with probability >= 1 - BETA."""
    return math.sqrt(math.log(1 / BETA) / (2 * n))


def matches(counts: torch.Tensor, exact: torch.Tensor) -> tuple[bool, str]:
    """The exactness check: (passed, description). Mutants must fail exactly this."""
    tv, limit, p_value = law_stats(counts, exact)
    passed = tv < limit and p_value > ALPHA
    return passed, f"TV {tv:.5f} (limit {limit:.5f}), chi-square p-value {p_value:.2e}, n = {int(counts.sum())}"


# ---- sampling through the decoder -------------------------------------------------------------------------------

def speculative_counts(target, drafter, params: SamplingParams, n: int, seed: int,
                       draft_threshold: float = 0.0) -> tuple[torch.Tensor, dict]:
    """n rows of the real speculative loop -> (counts [V^3] of (x1, x2, x3), acceptance totals)."""
    counts = torch.zeros(V ** 3, dtype=torch.long)
    proposed, accepted, steps = [0] * (BLOCK - 1), [0] * (BLOCK - 1), 0
    for call, lo in enumerate(range(0, n, BATCH)):
        rows = min(BATCH, n - lo)
        decoder = SpeculativeDecoder(TorchTarget(target), TorchDrafter(drafter), block_size=BLOCK, params=params,
                                     seed=seed + call, draft_threshold=draft_threshold)
        done = decoder.generate([Request(PROMPT, NEW)] * rows)
        assert all(c.finish_reason == "length" for c in done)
        ids = torch.tensor([c.output_ids for c in done])
        assert ids.shape == (rows, NEW) and bool(((ids >= 0) & (ids < V)).all())
        counts += torch.bincount((ids * torch.tensor([V * V, V, 1])).sum(-1), minlength=V ** 3)
        m = decoder.metrics
        proposed = [total + k for total, k in zip(proposed, m.proposed)]
        accepted = [total + k for total, k in zip(accepted, m.accepted)]
        steps += m.steps
    return counts, dict(acceptance=[a / p for a, p in zip(accepted, proposed)], steps_per_row=steps / n,
                        proposed=[k / steps for k in proposed])


# ---- the models are a meaningful test bed -------------------------------------------------------------------------

def test_target_and_selector_are_non_trivial(target, drafter, case):
    """p peaked but not one-hot, and context-dependent; q (one real draft) neither one-hot nor equal to p; top-p
    cuts tokens; the K candidates miss part of p's mass, which then can only come from the residual."""
    params, exact = case
    _, p = target_rows(target, params)
    p = p.double()
    p_x1 = p[0, 0]
    entropy = lambda r: float(-(r[r > 0] * r[r > 0].log()).sum()) / math.log(V)  # noqa: E731, normalized to [0, 1]
    assert 0.2 < entropy(p_x1) < 0.8 and 0.25 < entropy(exact) / 3 < 0.75, (entropy(p_x1), entropy(exact) / 3)
    assert float((p == 0).double().mean()) > 0.05, "top-p 0.99 should cut some tokens"
    assert float((p[::V, 1] - p[:V, 1]).abs().sum(-1).max()) > 0.5, "p(x2 | x1) should depend on x1"

    # one draft per possible x1, after the prompt's context, exactly as the decoder's first step sees it
    tt, td = TorchTarget(target), TorchDrafter(drafter)
    tt.allocate(V, len(PROMPT) + 1)
    td.allocate(V)
    out = tt.forward(torch.tensor(PROMPT).expand(V, len(PROMPT)), torch.arange(V), taps=td.target_layer_ids)
    td.append_context(out.taps, torch.arange(V), torch.full((V,), len(PROMPT)))
    step = td.drafter.draft(td.cache, torch.arange(V), BLOCK)  # the lattice itself, before any walk
    assert step.cand_ids.shape == (V, BLOCK - 1, K)
    q0 = draft_probs(step.scores[:, 0, 0], params.temperature, params.top_p).double()      # [x1, K]
    q1 = draft_probs(step.scores[:, 1], params.temperature, params.top_p).double()         # [x1, pred, K]
    q0_dense = torch.zeros(V, V, dtype=torch.float64).scatter_add(1, step.cand_ids[:, 0], q0)
    p_x2 = p[::V, 1]  # [x1, V] p(x2 | x1)
    weigh = lambda per_x1: float((p_x1 * per_x1).sum())  # noqa: E731, average over x1 ~ p
    mean_max_q = weigh(q0.max(-1).values)
    tv_qp = weigh(0.5 * (q0_dense - p_x2).abs().sum(-1))
    accept = weigh(torch.minimum(q0_dense, p_x2).sum(-1))
    outside = weigh((p_x2 * (q0_dense == 0)).sum(-1))
    row_shift = weigh(0.5 * (q1 - q1[:, :1]).abs().sum(-1).amax(-1))  # slot 1's q depends on slot 0's choice
    summary = dict(mean_max_q=mean_max_q, tv_qp=tv_qp, accept=accept, outside=outside, row_shift=row_shift)
    print(f"T={params.temperature}: H(x1) {entropy(p_x1):.2f}, H(joint)/3 {entropy(exact) / 3:.2f}, "
          f"cut {float((p == 0).double().mean()):.2f}, max q {float(q0.max()):.3f}, "
          + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    assert mean_max_q < 0.8 and float(q0.max()) < 1, summary
    assert tv_qp > 0.3 and 0.15 < accept < 0.85 and outside > 0.1 and row_shift > 0.1, summary


# ---- exactness --------------------------------------------------------------------------------------------------

def test_speculative_sampling_matches_the_exact_joint(target, drafter, case):
    params, exact = case
    n = SAMPLES[params.temperature]
    limit = tv_limit(exact, n)
    assert limit + power_margin(n) <= BIAS, (limit, power_margin(n))  # the sensitivity the sample count buys
    start = time.perf_counter()
    counts, stats = speculative_counts(target, drafter, params, n, seed=1000)
    passed, what = matches(counts, exact)
    print(f"T={params.temperature}: {what}, acceptance per slot {stats['acceptance']}, "
          f"{stats['steps_per_row']:.2f} steps/row, {time.perf_counter() - start:.1f} s")
    assert passed, what
    # both verification outcomes carry real mass at both draft slots
    assert 0.15 < stats["acceptance"][0] < 0.85 and stats["acceptance"][1] > 0.04, stats


def test_cut_proposals_match_the_exact_joint(target, drafter):
    """With a draft threshold the decoder proposes 0, 1 or 2 drafts per row (ragged within a batch, cut by the
    drafter's confidence before each draft is drawn), and the joint is still the target's (T = 0.7)."""
    params = SamplingParams(temperature=0.7, top_p=TOP_P)
    exact, n = exact_joint(target, params), SAMPLES[0.7]
    counts, stats = speculative_counts(target, drafter, params, n, seed=3000, draft_threshold=0.6)
    passed, what = matches(counts, exact)
    print(f"T=0.7, draft threshold 0.6: {what}, proposed per step {stats['proposed']}")
    assert passed, what
    assert 0.3 < stats["proposed"][0] < 0.9 and 0.01 < stats["proposed"][1] < 0.2, stats  # all three lengths occur


@pytest.mark.parametrize("shape", ["one_cell", "spread"])
def test_a_one_percent_bias_fails_at_this_sample_size(case, shape):
    """Positive control, without the decoder: rows drawn from the exact law moved by exactly 1% TV fail the check
    (and rows from the exact law itself pass it)."""
    params, exact = case
    n = SAMPLES[params.temperature]
    biased = exact.clone()
    if shape == "one_cell":  # 0.01 from the likeliest cell to the least likely possible one
        biased[exact.argmax()] -= BIAS
        biased[torch.where(exact > 0, exact, 2.0).argmin()] += BIAS
    else:  # every cell moved in proportion to its mass: +/- alternately in rank order, 0.01 each way
        order = exact.argsort(descending=True)
        up, down = order[0::2], order[1::2]
        biased[up] *= 1 + BIAS / float(exact[up].sum())
        biased[down] *= 1 - BIAS / float(exact[down].sum())
    assert abs(0.5 * float((biased - exact).abs().sum()) - BIAS) < 1e-9 and float(biased.min()) >= 0
    g = torch.Generator().manual_seed(7)
    draw = lambda law: torch.bincount(torch.multinomial(law, n, replacement=True, generator=g),  # noqa: E731
                                      minlength=V ** 3)
    passed, what = matches(draw(biased), exact)
    print(f"T={params.temperature} {shape} 1% bias: {what}")
    assert not passed, f"a {BIAS:.0%} TV bias went undetected: {what}"
    passed, what = matches(draw(exact), exact)
    print(f"T={params.temperature} exact law: {what}")
    assert passed, what


# ---- mutant verifiers (kept): each breaks one rule of speculative sampling; the same check must fail ----------

@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_wrong_verifier_fails_the_same_check(target, drafter, case, monkeypatch, mutant):
    params, exact = case
    name, wrong = MUTANTS[mutant]
    monkeypatch.setattr(verify_mod, name, wrong)
    counts, _ = speculative_counts(target, drafter, params, MUTANT_SAMPLES, seed=2000)
    passed, what = matches(counts, exact)
    print(f"T={params.temperature} {mutant}: {what}")
    assert not passed, f"{mutant} went undetected: {what}"
