"""DFlash 2 selector walk: greedy and sampled walks against explicit loops, and the law of the sampled draws."""

from __future__ import annotations

import math

import pytest
import torch

from beamtrt.spec.sampling import SamplingParams, target_probs
from beamtrt.spec.selector import ANCHOR_ROW, draft_probs, walk_greedy, walk_sampled

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run best on one thread

ALPHA = 1e-6  # false-alarm probability allowed to each statistical check (the tests are seeded, so deterministic)


def random_lattice(n: int, s: int, k: int, vocab: int, seed: int, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    cand_ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n * s)]).view(n, s, k)
    scores = torch.randn(n, s, k, k, generator=g) * scale
    scores[:, 0] = scores[:, 0, :1]  # slot 0: one predecessor (the anchor), so all K rows are the same
    return cand_ids, scores


def reference_top_p(q: list[float], top_p: float) -> list[float]:
    """Keep the fewest highest-q candidates whose mass reaches top_p (ties: lower index first), renormalize."""
    order = sorted(range(len(q)), key=lambda j: (-q[j], j))
    kept, mass = set(), 0.0
    for j in order:
        if mass >= top_p:
            break
        kept.add(j)
        mass += q[j]
    total = sum(q[j] for j in kept)
    return [q[j] / total if j in kept else 0.0 for j in range(len(q))]


def reference_walk(cand_ids, scores, temperature=None, top_p=1.0, uniforms=None):
    """Plain Python walk, one request and one slot at a time -> (draft ids, chosen, q rows as lists)."""
    n, s, k = cand_ids.shape
    drafts, chosen, qs = [], [], []
    for r in range(n):
        prev, d, c, qr = ANCHOR_ROW, [], [], []
        for t in range(s):
            row = scores[r, t, prev].tolist()
            if temperature is None:
                j = max(range(k), key=lambda i: row[i])
            else:
                m = max(row)
                e = [math.exp((x - m) / temperature) for x in row]
                q = reference_top_p([x / sum(e) for x in e], top_p)
                cdf, j = 0.0, k - 1
                for i in range(k):
                    cdf += q[i]
                    if float(uniforms[r, t]) < cdf and q[i] > 0:
                        j = i
                        break
                qr.append(q)
            prev = j
            c.append(j)
            d.append(int(cand_ids[r, t, j]))
        drafts.append(d), chosen.append(c), qs.append(qr)
    return torch.tensor(drafts), torch.tensor(chosen), qs


def test_docstring_examples():
    cand_ids = torch.tensor([[[10, 11], [20, 21]]])
    scores = torch.tensor([[[[0.1, 0.9], [0.1, 0.9]], [[5.0, 0.0], [0.0, 5.0]]]])
    draft, chosen = walk_greedy(cand_ids, scores)
    assert draft.tolist() == [[11, 21]] and chosen.tolist() == [[1, 1]]

    scores = torch.zeros(1, 2, 2, 2)
    scores[0, 1, 1, 1] = math.log(3.0)
    draft, q = walk_sampled(cand_ids, scores, 1.0, 1.0, torch.tensor([[0.7, 0.2]]))
    assert draft.tolist() == [[11, 20]]
    torch.testing.assert_close(q, torch.tensor([[[0.5, 0.5], [0.25, 0.75]]]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_walk_matches_python_loop(seed):
    cand_ids, scores = random_lattice(n=6, s=7, k=5, vocab=50, seed=seed)
    draft, chosen = walk_greedy(cand_ids, scores)
    ref_draft, ref_chosen, _ = reference_walk(cand_ids, scores)
    assert torch.equal(chosen, ref_chosen) and torch.equal(draft, ref_draft)
    assert draft.shape == chosen.shape == (6, 7) and draft.dtype == chosen.dtype == torch.long


def test_greedy_walk_with_identical_rows_is_per_slot_argmax():
    """Zero codebooks: S_t(a, b) = U_t(b) for every predecessor a, so the walk is the DFlash v1 argmax per slot."""
    g = torch.Generator().manual_seed(3)
    cand_ids, _ = random_lattice(n=8, s=7, k=6, vocab=100, seed=3)
    unary = torch.randn(8, 7, 6, generator=g)
    draft, chosen = walk_greedy(cand_ids, unary.unsqueeze(2).expand(8, 7, 6, 6))
    assert torch.equal(chosen, unary.argmax(-1))
    assert torch.equal(draft, cand_ids.gather(-1, unary.argmax(-1, keepdim=True)).squeeze(-1))


def test_greedy_walk_follows_the_predecessor_row():
    """Row i of slot t is used only when slot t-1 chose i: here row 0 would pick candidate 0, row 2 picks 3."""
    cand_ids = torch.arange(8).view(1, 2, 4)
    scores = torch.zeros(1, 2, 4, 4)
    scores[0, 0, :, 2] = 1.0   # slot 0 picks candidate 2
    scores[0, 1, 0, 0] = 1.0
    scores[0, 1, 2, 3] = 1.0
    draft, chosen = walk_greedy(cand_ids, scores)
    assert chosen.tolist() == [[2, 3]] and draft.tolist() == [[2, 7]]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 1.0), (1.3, 0.7), (0.8, 0.35)])
def test_sampled_walk_matches_python_loop(temperature, top_p):
    cand_ids, scores = random_lattice(n=6, s=7, k=5, vocab=50, seed=4)
    uniforms = torch.rand(6, 7, generator=torch.Generator().manual_seed(5))
    draft, q = walk_sampled(cand_ids, scores, temperature, top_p, uniforms)
    ref_draft, _, ref_q = reference_walk(cand_ids, scores, temperature, top_p, uniforms)
    assert torch.equal(draft, ref_draft)
    assert q.dtype == torch.float32 and q.shape == (6, 7, 5)
    torch.testing.assert_close(q, torch.tensor(ref_q), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q.sum(-1), torch.ones(6, 7))
    if top_p < 1:
        assert (q == 0).any(), "top-p should have cut some candidates"


def test_returned_q_is_the_row_of_the_chosen_predecessor():
    cand_ids, scores = random_lattice(n=64, s=5, k=4, vocab=30, seed=6, scale=3.0)
    draft, q = walk_sampled(cand_ids, scores, 0.9, 0.9, torch.rand(64, 5, generator=torch.Generator().manual_seed(7)))
    chosen = (cand_ids == draft.unsqueeze(-1)).long().argmax(-1)  # candidates are distinct within a slot
    assert torch.equal(cand_ids.gather(-1, chosen.unsqueeze(-1)).squeeze(-1), draft)
    assert (q.gather(-1, chosen.unsqueeze(-1)) > 0).all(), "a draft was drawn outside its q row's support"
    rows = torch.arange(64)
    torch.testing.assert_close(q[:, 0], draft_probs(scores[:, 0, ANCHOR_ROW], 0.9, 0.9), rtol=0, atol=0)
    not_row0 = 0
    for t in range(1, 5):
        torch.testing.assert_close(q[:, t], draft_probs(scores[rows, t, chosen[:, t - 1]], 0.9, 0.9), rtol=0, atol=0)
        other = draft_probs(scores[rows, t, (chosen[:, t - 1] + 1) % 4], 0.9, 0.9)
        assert not torch.allclose(q[:, t], other), "q would not tell the predecessor rows apart"
        not_row0 += int((chosen[:, t - 1] != 0).sum())
    assert not_row0 > 50  # the check above is meaningful only if predecessors other than row 0 occur


def test_sampled_draws_follow_q():
    """Joint law of (choice at slot 0, choice at slot 1) over many uniforms vs q_0(i) q_1(j | i)."""
    n, k = 200_000, 3
    cand_ids = torch.arange(2 * k).view(1, 2, k).expand(n, 2, k)
    scores = torch.tensor([[[0.0, 1.0, -0.5]] * 3, [[0.0, 0.0, 2.0], [1.5, -1.0, 0.0], [0.3, 0.2, 0.1]]])
    draft, q = walk_sampled(cand_ids, scores.expand(n, 2, k, k), 0.8, 1.0,
                            torch.rand(n, 2, generator=torch.Generator().manual_seed(8)))
    q0 = torch.softmax(scores[0, 0] / 0.8, -1)
    q1 = torch.softmax(scores[1] / 0.8, -1)  # [K predecessor, K]
    expected = (q0.unsqueeze(1) * q1).flatten().double()
    counts = torch.bincount(draft[:, 0] * k + (draft[:, 1] - k), minlength=k * k).double()
    tv = 0.5 * float((counts / n - expected).abs().sum())
    # E[TV] <= sum sqrt(p (1 - p) / n) / 2 (Jensen); one sample moves TV by <= 1/n, so McDiarmid adds the tail.
    limit = (0.5 * float((expected * (1 - expected)).sqrt().sum()) / math.sqrt(n)
             + math.sqrt(math.log(1 / ALPHA) / (2 * n)))
    chi2 = float(((counts - n * expected) ** 2 / (n * expected)).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((k * k - 1) / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert tv < limit and p_value > ALPHA, f"TV {tv:.5f} (limit {limit:.5f}), chi-square p-value {p_value:.2e}"
    assert limit < 0.01
    torch.testing.assert_close(q[:, 0], q0.expand(n, k))


def test_top_p_truncated_draw_stays_in_support():
    """A uniform that rounded up to 1.0 must not land on a candidate top-p removed."""
    cand_ids = torch.arange(3).view(1, 1, 3)
    scores = torch.tensor([2.0, 1.0, -3.0]).expand(1, 1, 3, 3)
    draft, q = walk_sampled(cand_ids, scores, 1.0, 0.9, torch.ones(1, 1))
    assert q[0, 0, 2] == 0 and draft.item() == 1


def test_bad_settings_raise():
    cand_ids, scores = random_lattice(n=1, s=2, k=2, vocab=4, seed=9)
    with pytest.raises(ValueError, match="temperature"):
        walk_sampled(cand_ids, scores, 0.0, 1.0, torch.rand(1, 2))
    for top_p in (0.0, 1e-300):  # 1e-300 is 0 as the float32 q is compared with: every candidate dropped, q NaN
        with pytest.raises(ValueError, match="top_p"):
            walk_sampled(cand_ids, scores, 1.0, top_p, torch.rand(1, 2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(0.7, 1e-46)
    probs = target_probs(torch.tensor([3.0, 1.0, 0.0]), SamplingParams(0.7, 1e-44))  # the least that is not 0: argmax
    assert probs.tolist() == [1.0, 0.0, 0.0]
