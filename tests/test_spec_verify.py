"""Verification: greedy matching, and statistical exactness of speculative sampling (with mutants that must fail).

Exactness tests simulate one big batch of N independent chains over a small vocabulary with fixed target rows
p_t and check that the emitted token at position j, among the chains that accepted their first j drafts, has law
p_j (Leviathan et al. 2023, theorem 1). The limits come from the sample count (see `law_stats`), so a wrong
verifier, e.g. one with a 1% total-variation bias on the first emitted token, fails them.
"""

from __future__ import annotations

import pytest
import torch

from beamtrt.runtime.backend import DraftStep
from beamtrt.spec import verify as verify_mod
from beamtrt.spec.decoder import proposal_lengths
from beamtrt.spec.sampling import SamplingParams, sample_from, target_probs
from beamtrt.spec.selector import draft_confidence, draft_probs, walk_greedy, walk_sampled
from beamtrt.spec.verify import PLACEHOLDER_TOKEN_ID, VerifyResult, onehot_q, verify_greedy, verify_sampled
from spec_stats import ALPHA, MUTANTS, law_stats

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run best on one thread

N_CHAINS = 1_000_000  # TV limit at the first emitted position ~0.004 for V = 8, well below a 1% bias
V, K, GAMMA = 8, 4, 3


# ------------------------------------------------------------------------------------- the target's law


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 50, 1.0), (0.7, 20, 0.8),
                                                       (0.5, 1, 1.0), (2.0, 0, 0.05), (0.7, 200, 0.99)])
def test_target_probs_equal_hugging_faces_warpers(temperature, top_k, top_p):
    """The law every sampled token is drawn from (plain decoding and verification alike, so the exactness tests,
    which build their exact laws with it, cannot see a fault in it): temperature, then top-k, then top-p, as Hugging
    Face's `generate` applies its warpers, here computed by transformers' own."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = 3 * torch.randn(64, 100, generator=torch.Generator().manual_seed(7))  # no ties: any order keeps the same
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    want = want.softmax(-1)
    got = target_probs(logits, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    assert torch.equal(got > 0, want > 0)  # the same tokens kept
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    cuts = 0 < top_k < logits.shape[-1] or top_p < 1
    assert (got > 0).any(-1).all() and bool((got == 0).any()) == cuts  # a case with a cut does cut tokens


def test_top_p_keeps_as_many_tokens_as_hugging_face_at_an_exact_boundary():
    """Mass that reaches top_p exactly (equal logits: quarters, halves) stops the prefix there, on the target's side
    as in Hugging Face's TopPLogitsWarper, and on the drafter's over its candidates (a cut one past the boundary, which
    kept every tied token, survived the test above, whose random logits have no such sums)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    for width, top_p, kept in ((4, 0.5, 2), (4, 0.25, 1), (2, 0.5, 1), (4, 0.75, 3)):
        logits = torch.zeros(1, width)
        want = TopPLogitsWarper(top_p)(None, logits.clone()).softmax(-1)
        got = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
        q = draft_probs(logits, 1.0, top_p)
        assert int((want > 0).sum()) == int((got > 0).sum()) == int((q > 0).sum()) == kept, (width, top_p)
        assert torch.equal(got, q) and torch.equal(got[got > 0], torch.full((kept,), 1 / kept))


# ----------------------------------------------------------------------------------------------- greedy


def logits_with_argmax(argmax: torch.Tensor, vocab: int, seed: int = 0) -> torch.Tensor:
    """argmax [N, γ+1] -> random logits [N, γ+1, V] whose argmax per row is the given token."""
    logits = torch.randn(*argmax.shape, vocab, generator=torch.Generator().manual_seed(seed))
    return logits.scatter(-1, argmax.unsqueeze(-1), 10.0)


def test_greedy_all_accepted_emits_bonus():
    draft = torch.tensor([[5, 7, 9]])
    result = verify_greedy(draft, logits_with_argmax(torch.tensor([[5, 7, 9, 4]]), 12))
    assert result.num_accepted.tolist() == [3] and result.tokens.tolist() == [[5, 7, 9, 4]]
    assert result.num_emitted.tolist() == [4]


def test_greedy_first_mismatch_emits_recovered():
    draft = torch.tensor([[5, 7, 9]])
    result = verify_greedy(draft, logits_with_argmax(torch.tensor([[5, 7, 2, 9]]), 12))
    assert result.num_accepted.tolist() == [2] and result.tokens.tolist() == [[5, 7, 2, PLACEHOLDER_TOKEN_ID]]


def test_greedy_ragged_batch_and_placeholders():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    argmax = torch.tensor([[0, 2, 3, 4],    # mismatch at slot 0; later matches must not count
                           [1, 0, 3, 4],    # mismatch at slot 1
                           [1, 2, 0, 4],    # mismatch at slot 2
                           [1, 2, 3, 4]])   # all accepted
    result = verify_greedy(draft, logits_with_argmax(argmax, 6))
    assert PLACEHOLDER_TOKEN_ID == -1
    assert result.num_accepted.tolist() == [0, 1, 2, 3]
    assert result.num_emitted.tolist() == [1, 2, 3, 4]
    assert result.tokens.tolist() == [[0, -1, -1, -1], [1, 0, -1, -1], [1, 2, 0, -1], [1, 2, 3, 4]]
    assert result.tokens.dtype == result.num_accepted.dtype == torch.long


def test_greedy_matches_python_loop():
    g = torch.Generator().manual_seed(1)
    n, gamma, vocab = 64, 7, 5  # small vocab: drafts often match by chance, so all acceptance lengths occur
    logits = torch.randn(n, gamma + 1, vocab, generator=g)
    draft = torch.where(torch.rand(n, gamma, generator=g) < 0.8, logits[:, :gamma].argmax(-1),
                        torch.randint(vocab, (n, gamma), generator=g))
    result = verify_greedy(draft, logits)
    for r in range(n):
        a = 0
        while a < gamma and draft[r, a] == logits[r, a].argmax():
            a += 1
        expected = draft[r, :a].tolist() + [int(logits[r, a].argmax())] + [PLACEHOLDER_TOKEN_ID] * (gamma - a)
        assert result.num_accepted[r] == a and result.tokens[r].tolist() == expected
    assert len(set(result.num_accepted.tolist())) >= 4


# ----------------------------------------------------------------------------------------------- sampled, unit


def test_sampled_docstring_example():
    p = torch.tensor([[[0.2, 0.5, 0.3], [0.3, 0.3, 0.4]]])
    result = verify_sampled(torch.tensor([[0]]), torch.tensor([[[0, 1]]]), torch.tensor([[[0.6, 0.4]]]), p,
                            torch.tensor([[0.5]]), torch.tensor([0.1]))
    assert result.num_accepted.tolist() == [0] and result.tokens.tolist() == [[1, -1]]
    # u_accept = 0.3 < p/q = 1/3: accepted, then the bonus comes from p[1]: u = 0.1 -> token 0
    result = verify_sampled(torch.tensor([[0]]), torch.tensor([[[0, 1]]]), torch.tensor([[[0.6, 0.4]]]), p,
                            torch.tensor([[0.3]]), torch.tensor([0.1]))
    assert result.num_accepted.tolist() == [1] and result.tokens.tolist() == [[0, 0]]


def test_q_equal_to_p_accepts_everything():
    g = torch.Generator().manual_seed(2)
    n = 256
    cand_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n * GAMMA)]).view(n, GAMMA, K)
    q = torch.softmax(torch.randn(n, GAMMA, K, generator=g), -1)
    p = torch.zeros(n, GAMMA + 1, V)
    p[:, :GAMMA].scatter_(-1, cand_ids, q)
    p[:, GAMMA] = torch.softmax(torch.randn(n, V, generator=g), -1)
    chosen = sample_from(q, torch.rand(n, GAMMA, generator=g))
    draft = cand_ids.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    result = verify_sampled(draft, cand_ids, q, p, torch.rand(n, GAMMA, generator=g), torch.rand(n, generator=g))
    assert (result.num_accepted == GAMMA).all()
    assert torch.equal(result.tokens[:, :GAMMA], draft)


def test_draft_with_zero_target_probability_is_rejected():
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]]).expand(100, 2, 3)
    u = torch.linspace(0, 0.999, 100)
    result = verify_sampled(torch.zeros(100, 1, dtype=torch.long), torch.tensor([[[0, 1]]]).expand(100, 1, 2),
                            torch.tensor([[[0.9, 0.1]]]).expand(100, 1, 2), p, u.view(100, 1), u)
    assert (result.num_accepted == 0).all()
    # residual max(0, p - q) = [0, 0.4, 0.5]: token 1 for u < 4/9, token 2 above
    assert torch.equal(result.tokens[:, 0], (u >= 4 / 9).long() + 1)


def test_onehot_q_and_none_agree():
    """q = None (δ at the draft) and onehot_q(chosen, K) over the lattice's candidates are the same verifier."""
    g = torch.Generator().manual_seed(3)
    n = 512
    cand_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n * GAMMA)]).view(n, GAMMA, K)
    draft, chosen = walk_greedy(cand_ids, torch.randn(n, GAMMA, K, K, generator=g))
    q = onehot_q(chosen, K)
    assert q.shape == (n, GAMMA, K) and q.dtype == torch.float32 and torch.equal(q.sum(-1), torch.ones(n, GAMMA))
    p = torch.softmax(torch.randn(n, GAMMA + 1, V, generator=g), -1)
    u_accept, u_residual = torch.rand(n, GAMMA, generator=g), torch.rand(n, generator=g)
    a = verify_sampled(draft, None, None, p, u_accept, u_residual)
    b = verify_sampled(draft, cand_ids, q, p, u_accept, u_residual)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.tokens, b.tokens)
    # δ proposal: accept iff u < p(x); the recovered token is never the rejected draft
    p_draft = p[:, :GAMMA].gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    assert torch.equal(a.num_accepted, (u_accept < p_draft).long().cumprod(-1).sum(-1))
    rejected = a.num_accepted < GAMMA
    at = a.num_accepted[rejected].unsqueeze(1)
    assert (a.tokens[rejected].gather(1, at) != draft[rejected].gather(1, at)).all()


def test_residual_falls_back_to_p_when_empty():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert torch.equal(verify_mod._residual(p, torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])), p)
    torch.testing.assert_close(verify_mod._residual(p, torch.tensor([[0, 1]]), torch.tensor([[0.7, 0.3]])),
                               torch.tensor([[0.0, 0.2, 0.0, 0.0]]))


def test_draw_stays_in_support():
    """A uniform that rounded up to 1.0 must not land on the zero-probability tail (sample_from clamps to V - 1)."""
    probs = torch.tensor([[0.3, 0.4, 0.0, 0.0]])
    assert verify_mod._draw(probs, torch.ones(1)).item() == 1


# ----------------------------------------------------------------------------------------------- sampled, law


def emitted_at(result: VerifyResult, j: int) -> torch.Tensor:
    """Emitted token j of the chains that accepted their first j drafts (its law must be p_j)."""
    return result.tokens[result.num_accepted >= j, j]


def token_stats(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, float, float]:
    """tokens [n] drawn iid, p [V] -> `law_stats` of their counts."""
    return law_stats(torch.bincount(tokens, minlength=p.numel()), p)


def assert_law(tokens: torch.Tensor, p: torch.Tensor, what: str) -> None:
    tv, limit, p_value = token_stats(tokens, p)
    assert tv < limit and p_value > ALPHA, \
        f"{what}: TV {tv:.5f} (limit {limit:.5f}), chi-square p-value {p_value:.2e}, n = {tokens.numel()}"


def target_rows(g: torch.Generator, cand_ids: torch.Tensor) -> torch.Tensor:
    """[γ+1, V] target rows: random, one candidate of slot 0 with p = 0 (q > 0 there: always rejected)."""
    p = torch.softmax(torch.randn(cand_ids.shape[0] + 1, V, generator=g), -1)
    p[0, cand_ids[0, 0]] = 0.0
    return p / p.sum(-1, keepdim=True)


@pytest.fixture(scope="module")
def single_slot():
    """γ = 1: K candidates with random q, drafts drawn from q; fixed target rows p [2, V]."""
    g = torch.Generator().manual_seed(10)
    cand = torch.randperm(V, generator=g)[:K].view(1, K)
    q = torch.softmax(torch.randn(1, K, generator=g), -1)
    p = target_rows(g, cand)
    draft = cand[0, sample_from(q.expand(N_CHAINS, K), torch.rand(N_CHAINS, generator=g))].view(N_CHAINS, 1)
    inputs = dict(draft_ids=draft, cand_ids=cand.expand(N_CHAINS, 1, K), q=q.expand(N_CHAINS, 1, K),
                  p=p.expand(N_CHAINS, 2, V), u_accept=torch.rand(N_CHAINS, 1, generator=g),
                  u_residual=torch.rand(N_CHAINS, generator=g))
    q_dense = torch.zeros(V).scatter(0, cand[0], q[0])
    assert p[0, ~torch.isin(torch.arange(V), cand[0])].sum() > 0.1, "p needs mass outside the candidates"
    assert 0.2 < float(torch.minimum(p[0], q_dense).sum()) < 0.9, "acceptance should be neither rare nor certain"
    return inputs, p


def test_single_slot_is_exact(single_slot):
    inputs, p = single_slot
    result = verify_sampled(**inputs)
    assert_law(emitted_at(result, 0), p[0], "first emitted token")
    assert_law(emitted_at(result, 1), p[1], "bonus token")
    assert token_stats(emitted_at(result, 0), p[0])[1] < 0.005  # a 1% TV bias is far above the limit


def test_statistic_detects_a_one_percent_bias(single_slot):
    """The checks' power: draws from p moved by exactly 0.01 in total variation fail them."""
    _, p = single_slot
    biased = p[0].clone()
    hi, lo = int(p[0].argmax()), int((p[0] + (p[0] == 0).float()).argmin())
    biased[hi] -= 0.01
    biased[lo] += 0.01
    tokens = sample_from(biased.expand(N_CHAINS, V), torch.rand(N_CHAINS, generator=torch.Generator().manual_seed(11)))
    tv, limit, p_value = token_stats(tokens, p[0])
    assert tv > limit and p_value < ALPHA, (tv, limit, p_value)


@pytest.fixture(scope="module")
def three_slot_lattice():
    """γ = 3 chain on a DFlash 2 lattice: the scores favour the target's tokens, with per-predecessor noise."""
    g = torch.Generator().manual_seed(12)
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(GAMMA)])  # [γ, K]
    p = target_rows(g, cand)
    scores = (p[:GAMMA].gather(-1, cand) + 0.05).log().unsqueeze(1) + 0.7 * torch.randn(GAMMA, K, K, generator=g)
    scores[0] = scores[0, :1]
    return cand, scores, p


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8)])
def test_three_slot_selector_chain_is_exact(three_slot_lattice, temperature, top_p):
    cand, scores, p = three_slot_lattice
    g = torch.Generator().manual_seed(13)
    n = N_CHAINS
    cand_ids = cand.expand(n, GAMMA, K)
    draft, q = walk_sampled(cand_ids, scores.expand(n, GAMMA, K, K), temperature, top_p,
                            torch.rand(n, GAMMA, generator=g))
    result = verify_sampled(draft, cand_ids, q, p.expand(n, GAMMA + 1, V), torch.rand(n, GAMMA, generator=g),
                            torch.rand(n, generator=g))
    for j in range(GAMMA + 1):
        assert_law(emitted_at(result, j), p[j], f"emitted token {j}")
    assert (result.num_accepted == GAMMA).sum() > 10_000, "the bonus position needs samples"
    assert torch.equal((result.tokens != PLACEHOLDER_TOKEN_ID).sum(-1), result.num_emitted)


def test_three_slot_greedy_walk_with_sampled_target_is_exact(three_slot_lattice):
    """Deterministic drafts with q = δ (q=None) are exact too; acceptance is p(x) per slot."""
    cand, scores, p = three_slot_lattice
    g = torch.Generator().manual_seed(14)
    n = N_CHAINS // 2
    draft, _ = walk_greedy(cand.expand(n, GAMMA, K), scores.expand(n, GAMMA, K, K))
    result = verify_sampled(draft, None, None, p.expand(n, GAMMA + 1, V), torch.rand(n, GAMMA, generator=g),
                            torch.rand(n, generator=g))
    for j in range(GAMMA + 1):
        assert_law(emitted_at(result, j), p[j], f"emitted token {j}")


# Mutants: each breaks one rule of the verifier. The exactness checks above must catch every one of them.
@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutant_verifier_fails_the_exactness_check(single_slot, monkeypatch, mutant):
    inputs, p = single_slot
    name, wrong = MUTANTS[mutant]
    monkeypatch.setattr(verify_mod, name, wrong)
    tv, limit, p_value = token_stats(emitted_at(verify_sampled(**inputs), 0), p[0])
    assert tv > limit and p_value < ALPHA, f"{mutant} went undetected: TV {tv:.5f} (limit {limit:.5f})"


@pytest.mark.parametrize("mutant", ["accept_with_1.5q", "residual_replaced_by_p"])
def test_mutant_verifier_fails_on_the_selector_chain(three_slot_lattice, monkeypatch, mutant):
    cand, scores, p = three_slot_lattice
    g = torch.Generator().manual_seed(15)
    n = N_CHAINS // 4
    cand_ids = cand.expand(n, GAMMA, K)
    draft, q = walk_sampled(cand_ids, scores.expand(n, GAMMA, K, K), 1.0, 1.0, torch.rand(n, GAMMA, generator=g))
    name, wrong = MUTANTS[mutant]
    monkeypatch.setattr(verify_mod, name, wrong)
    result = verify_sampled(draft, cand_ids, q, p.expand(n, GAMMA + 1, V), torch.rand(n, GAMMA, generator=g),
                            torch.rand(n, generator=g))
    stats = [token_stats(emitted_at(result, j), p[j]) for j in range(GAMMA)]
    assert any(tv > limit and p_value < ALPHA for tv, limit, p_value in stats), f"{mutant} went undetected: {stats}"


# ----------------------------------------------------------------------------------------------- sampled, cut


def cut_chain(three_slot_lattice, threshold: float, realized: bool, n: int, seed: int):
    """The selector chain with proposals cut by `decoder.proposal_lengths` -> (result, num_drafts, p). realized:
    the confidence of a slot is the q of its own drawn draft instead of its row's max (a cut that looks at the draft
    it is deciding about)."""
    cand, scores, p = three_slot_lattice
    g = torch.Generator().manual_seed(seed)
    cand_ids = cand.expand(n, GAMMA, K)
    draft, q = walk_sampled(cand_ids, scores.expand(n, GAMMA, K, K), 1.0, 1.0, torch.rand(n, GAMMA, generator=g))
    confidence = (q * (cand_ids == draft.unsqueeze(-1))).sum(-1) if realized else draft_confidence(q)
    num_drafts = proposal_lengths(DraftStep(draft, cand_ids, q, confidence), threshold)
    result = verify_sampled(draft, cand_ids, q, p.expand(n, GAMMA + 1, V), torch.rand(n, GAMMA, generator=g),
                            torch.rand(n, generator=g), num_drafts)
    return result, num_drafts, p


CUT = 0.2  # on this lattice: slot 1 proposed or cut depending on slot 0's draw, slot 2 mostly cut


def test_cut_proposals_are_exact(three_slot_lattice):
    """Proposals cut before each draft is drawn keep every emitted position's law; at a cut the bonus is drawn from
    the target's row there (a recovered token would be drawn from p - q of a slot that was never proposed)."""
    result, num_drafts, p = cut_chain(three_slot_lattice, CUT, False, N_CHAINS, seed=16)
    counts = torch.bincount(num_drafts, minlength=GAMMA + 1)  # slot 0's row is the anchor's: never cut here
    assert counts[1] > N_CHAINS // 4 and counts[2] > N_CHAINS // 4 and counts[3] > N_CHAINS // 200, counts
    assert bool((result.num_accepted <= num_drafts).all())
    for j in range(GAMMA):  # position 3 needs all 3 slots proposed and accepted: too rare to test here
        assert_law(emitted_at(result, j), p[j], f"emitted token {j}")


def test_a_cut_that_looks_at_its_draft_fails_the_exactness_check(three_slot_lattice):
    """Positive control: cutting on the drawn draft's own q biases the proposal law the verifier assumes."""
    result, _, p = cut_chain(three_slot_lattice, CUT, True, N_CHAINS, seed=17)
    stats = [token_stats(emitted_at(result, j), p[j]) for j in range(GAMMA)]
    assert any(tv > limit or p_value < ALPHA for tv, limit, p_value in stats), stats


def test_greedy_cut_accepts_at_most_the_proposed_drafts():
    draft = torch.tensor([[5, 7, 9], [5, 7, 9], [5, 7, 9]])
    argmax = torch.tensor([[5, 7, 9, 4]] * 3)  # every draft matches the target
    result = verify_greedy(draft, logits_with_argmax(argmax, 12), torch.tensor([0, 2, 3]))
    assert result.num_accepted.tolist() == [0, 2, 3]  # the bonus is the target's argmax at each cut
    assert result.tokens.tolist() == [[5, -1, -1, -1], [5, 7, 9, -1], [5, 7, 9, 4]]


def test_a_running_confidence_equal_to_the_threshold_keeps_its_draft():
    """The cut keeps the longest prefix whose confidence product stays >= the threshold, the product equal to it
    included: certain drafts (confidence 1) at --draft-threshold 1 are all proposed, and halves at 0.25 two of three."""
    for confidence, threshold, kept in (([1.0, 1.0, 1.0], 1.0, 3), ([0.5, 0.5, 0.5], 0.25, 2), ([0.5, 1.0], 0.5, 2)):
        c = torch.tensor([confidence])
        step = DraftStep(torch.zeros(c.shape, dtype=torch.long), torch.zeros(*c.shape, 1, dtype=torch.long), None, c)
        assert proposal_lengths(step, threshold).tolist() == [kept], (confidence, threshold)
