"""DFlash 2 candidate-selector walk: pick one draft path through a K-candidate lattice, slot by slot.

The drafter proposes K candidate tokens per draft slot and scores every edge between consecutive slots
(dflash.md §4.3; SGLang `CandidateSelector.sample_path`, NeMo `CandidateSelector.walk`). The walk is a
*local* forward walk, not Viterbi: slot t looks only at the row of its lattice picked by slot t-1's choice.
That locality is what makes the sampled walk exact under speculative sampling (dflash.md §4.4): the law of
x_t given the prefix is exactly the softmax row it was drawn from, and `walk_sampled` returns those very
fp32 rows for the verifier.

Lattice layout (N requests, S = block_size - 1 draft slots, K candidates per slot):
    cand_ids [N, S, K]      long   token id of candidate j at slot t
    scores   [N, S, K, K]   fp32   scores[n, t, i, j] = score of candidate j at slot t given slot t-1 chose i;
                                   slot 0's predecessor is the anchor token, so its K rows are identical and
                                   row ANCHOR_ROW is used.
All randomness enters as explicit uniforms (rank 0 draws and broadcasts them under tensor parallelism).
"""

from __future__ import annotations

import torch

from beamtrt.spec.sampling import sample_from, top_p_ok

ANCHOR_ROW = 0  # slot 0 has a single predecessor (the anchor); all its lattice rows are equal, use this one


def _check_lattice(cand_ids: torch.Tensor, scores: torch.Tensor) -> None:
    assert cand_ids.ndim == 3 and scores.ndim == 4, (cand_ids.shape, scores.shape)
    n, s, k = cand_ids.shape
    assert scores.shape == (n, s, k, k), (cand_ids.shape, scores.shape)


def _rows(scores: torch.Tensor, t: int, prev: torch.Tensor) -> torch.Tensor:
    """scores [N, S, K, K], prev [N] predecessor index per request -> the selected rows [N, K] of slot t."""
    return scores[torch.arange(scores.shape[0], device=scores.device), t, prev]


def walk_greedy(cand_ids: torch.Tensor,  # [N, S, K] long
                scores: torch.Tensor,    # [N, S, K, K] fp32
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local greedy walk: chosen_t = argmax_j scores[t, chosen_{t-1}, j] -> (draft_ids [N, S], chosen [N, S]).

    The proposal law of a greedy walk is a point mass, so a sampling verifier takes q = δ at the draft
    (`verify.onehot_q(chosen, K)` or `q=None`).

    Example (N=1, S=2, K=2; slot 0 rows are identical, so only row 0 matters):
        cand_ids = [[[10, 11], [20, 21]]]
        scores[0, 0] = [[0.1, 0.9], [0.1, 0.9]]   -> slot 0 picks j=1 (token 11)
        scores[0, 1] = [[5.0, 0.0], [0.0, 5.0]]   -> predecessor is 1, row 1 -> j=1 (token 21)
        walk_greedy(...) == (tensor([[11, 21]]), tensor([[1, 1]]))
    Per-slot argmax of row 0 would have picked token 20 at slot 1: the predecessor's row decides.
    """
    _check_lattice(cand_ids, scores)
    n, s, _ = cand_ids.shape
    chosen = torch.empty(n, s, dtype=torch.long, device=cand_ids.device)
    prev = torch.full((n,), ANCHOR_ROW, dtype=torch.long, device=cand_ids.device)
    for t in range(s):  # sequential by nature (S <= 15); vectorized over requests
        prev = _rows(scores, t, prev).argmax(-1)
        chosen[:, t] = prev
    return cand_ids.gather(-1, chosen.unsqueeze(-1)).squeeze(-1), chosen


def greedy_q(scores: torch.Tensor,  # [N, S, K, K] fp32
             chosen: torch.Tensor,  # [N, S] long, from walk_greedy
             ) -> torch.Tensor:
    """The rows a greedy walk read, as temperature-1 probabilities -> [N, S, K] fp32 (what the selector kernels
    output as q for greedy requests). Their max is the walk's confidence in each draft (`draft_confidence`); the
    verifier never sees them (a greedy path's proposal law is a point mass)."""
    assert scores.ndim == 4 and chosen.shape == scores.shape[:2], (scores.shape, chosen.shape)
    prev = torch.cat([torch.full_like(chosen[:, :1], ANCHOR_ROW), chosen[:, :-1]], dim=1)  # [N, S]
    rows = scores.gather(2, prev[:, :, None, None].expand(-1, -1, 1, scores.shape[-1])).squeeze(2)  # [N, S, K]
    return draft_probs(rows, 1.0)


def draft_confidence(q: torch.Tensor) -> torch.Tensor:
    """q [N, S, K] the walk's rows -> [N, S] the largest probability of each row.

    A slot's confidence is known before its draft is drawn (it depends on the earlier slots' choices only), so a
    proposal cut where the running product of confidences falls below a threshold (`SpeculativeDecoder`'s
    draft_threshold) decides whether to propose slot t without looking at draft t: sampled verification stays
    exact. A greedy walk's draft is its row's argmax, so there the confidence is that draft's probability.
    """
    return q.amax(-1)


def draft_probs(row_scores: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """row_scores [..., K] -> q [..., K] fp32: softmax(row / temperature), then top-p over the K candidates.

    Top-p keeps the smallest prefix of candidates (by decreasing q) whose mass reaches top_p, as the target's
    `sampling.target_probs` does, and renormalizes; top_p = 1 keeps every candidate.
    """
    if not temperature > 0 or not top_p_ok(top_p):
        raise ValueError(f"bad draft sampling settings: temperature={temperature} (> 0), top_p={top_p} (in (0, 1], at "
                         "least 1e-45)")
    q = torch.softmax(row_scores.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_q, order = torch.sort(q, dim=-1, descending=True, stable=True)
        drop = sorted_q.cumsum(-1) - sorted_q >= top_p  # mass strictly before this candidate already reaches top_p
        q = q.scatter(-1, order, sorted_q.masked_fill(drop, 0.0))
        q = q / q.sum(-1, keepdim=True)
    return q


def walk_sampled(cand_ids: torch.Tensor,  # [N, S, K] long
                 scores: torch.Tensor,    # [N, S, K, K] fp32
                 temperature: float,
                 top_p: float,
                 uniforms: torch.Tensor,  # [N, S] in [0, 1), one per slot
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled walk -> (draft_ids [N, S], q [N, S, K] fp32).

    q[n, t] = draft_probs(scores[n, t, chosen_{t-1}], temperature, top_p) is the exact row candidate t was drawn
    from (inverse CDF with uniforms[n, t]); the verifier must use these numbers unchanged (dflash.md §4.4,
    condition 2).

    Example (N=1, S=2, K=2, temperature=1, top_p=1):
        cand_ids = [[[10, 11], [20, 21]]]
        scores[0, 0] = [[0, 0], [0, 0]]             -> q_0 = [0.5, 0.5]; u_0 = 0.7 picks j=1 (token 11)
        scores[0, 1] = [[0, 0], [0, ln 3]]          -> predecessor 1 selects row [0, ln 3]: q_1 = [0.25, 0.75];
                                                       u_1 = 0.2 picks j=0 (token 20)
        walk_sampled(..., uniforms=[[0.7, 0.2]]) == (tensor([[11, 20]]), tensor([[[0.5, 0.5], [0.25, 0.75]]]))
    """
    _check_lattice(cand_ids, scores)
    n, s, k = cand_ids.shape
    assert uniforms.shape == (n, s), (uniforms.shape, (n, s))
    q = torch.empty(n, s, k, dtype=torch.float32, device=scores.device)
    chosen = torch.empty(n, s, dtype=torch.long, device=cand_ids.device)
    prev = torch.full((n,), ANCHOR_ROW, dtype=torch.long, device=cand_ids.device)
    for t in range(s):
        q[:, t] = draft_probs(_rows(scores, t, prev), temperature, top_p)
        prev = sample_from(q[:, t], uniforms[:, t])  # drawn from the stored row itself, bit for bit
        chosen[:, t] = prev
    return cand_ids.gather(-1, chosen.unsqueeze(-1)).squeeze(-1), q
