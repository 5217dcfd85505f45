"""Verification of a chain of draft tokens against the target: greedy matching and lossless speculative sampling.

Glossary (vLLM's `RejectionSampler` vocabulary):
    draft      a token proposed by the drafter for one of the γ draft slots.
    accepted   a draft token the verifier keeps. Drafts are accepted as a prefix: after the first rejection
               nothing later is kept.
    recovered  the token emitted at the first rejection in place of the rejected draft. Sampled: drawn from the
               residual norm(max(0, p - q)). Greedy: the target's argmax at the first mismatch.
    bonus      the token emitted after all γ drafts were accepted: drawn from (or the argmax of) the target's
               distribution at row γ.
Every step therefore emits num_accepted + 1 tokens: the accepted drafts, then one recovered or bonus token.

Sampled verification is the chain speculative sampling of Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding" (arXiv 2211.17192) and Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling" (arXiv 2302.01318): draft t is accepted with probability
min(1, p_t(x_t) / q_t(x_t)), so that every emitted token is distributed exactly as the target's p
(dflash.md §4.4). It needs q_t to be the exact row the draft was sampled from and fresh uniforms independent of
the draft's. Draft distributions are K-sparse (the selector's candidates); tokens outside them have q = 0, so
their whole p mass goes to the residual.

Shapes: N requests, γ draft slots, K candidates per slot, V vocabulary. Target rows: row t of the verify pass
(input [x_s, d_1..d_γ]) predicts draft slot t, row γ predicts the bonus position.
All randomness enters as explicit uniforms (rank 0 draws and broadcasts them under tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from beamtrt.spec.sampling import sample_from

PLACEHOLDER_TOKEN_ID = -1  # fills tokens[n, num_accepted[n] + 1:], the positions a step did not emit


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: torch.Tensor  # [N] long, 0..γ
    tokens: torch.Tensor        # [N, γ + 1] long: accepted drafts, the recovered/bonus token, then placeholders

    @property
    def num_emitted(self) -> torch.Tensor:  # [N] long, 1..γ + 1
        return self.num_accepted + 1


def _prefix_length(accept: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """accept [N, γ] bool, num_drafts [N] or None (all γ) -> [N] long: how many leading slots are accepted (a
    cumprod of the verdicts), slots at or past a request's num_drafts counting as rejected."""
    if num_drafts is not None:
        accept = accept & (torch.arange(accept.shape[1], device=accept.device) < num_drafts.unsqueeze(1))
    return accept.long().cumprod(-1).sum(-1)


def _emit(draft_ids: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> VerifyResult:
    """draft_ids [N, γ], num_accepted [N], last [N] recovered/bonus token -> VerifyResult with placeholders."""
    n, gamma = draft_ids.shape
    tokens = torch.cat([draft_ids, draft_ids.new_full((n, 1), PLACEHOLDER_TOKEN_ID)], dim=1)
    tokens.scatter_(1, num_accepted.unsqueeze(1), last.unsqueeze(1))
    pos = torch.arange(gamma + 1, device=tokens.device)
    return VerifyResult(num_accepted, tokens.masked_fill_(pos > num_accepted.unsqueeze(1), PLACEHOLDER_TOKEN_ID))


def verify_greedy(draft_ids: torch.Tensor,      # [N, γ] long
                  target_logits: torch.Tensor,  # [N, γ + 1, V]
                  num_drafts: torch.Tensor | None = None,  # [N] long in 0..γ, drafts proposed per request; None = γ
                  ) -> VerifyResult:
    """Greedy target (temperature 0): accept the longest prefix with draft_t == argmax(target row t), then emit the
    argmax of row num_accepted (recovered after a mismatch, bonus when all γ matched). Exact for any drafter.
    A request that proposed only its first num_drafts[n] drafts accepts at most those; its bonus is row num_drafts[n].

    Example (γ = 3): draft [5, 7, 9], target argmax per row [5, 7, 2, 4]
        -> num_accepted 2, tokens [5, 7, 2, -1] (2 is the recovered token).
    With argmax rows [5, 7, 9, 4] all drafts match: num_accepted 3, tokens [5, 7, 9, 4] (4 is the bonus).
    """
    assert draft_ids.ndim == 2 and target_logits.ndim == 3, (draft_ids.shape, target_logits.shape)
    n, gamma = draft_ids.shape
    assert target_logits.shape[:2] == (n, gamma + 1), (draft_ids.shape, target_logits.shape)
    argmax = target_logits.argmax(-1)  # [N, γ + 1]
    num_accepted = _prefix_length(draft_ids == argmax[:, :gamma], num_drafts)
    return _emit(draft_ids, num_accepted, argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1))


def onehot_q(chosen: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """chosen [N, γ] candidate indices (e.g. from `walk_greedy`) -> q [N, γ, K] fp32, a point mass at each choice.

    The proposal law of a deterministic path: verify_sampled accepts draft t with probability p_t(x_t), and the
    residual is p_t with x_t removed (dflash.md §4.4, "deterministic paths are always exact").
    """
    return torch.nn.functional.one_hot(chosen, num_candidates).float()


def _accepted(u_accept: torch.Tensor, q_draft: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """[N, γ] each -> [N, γ] bool. u < p/q, i.e. probability min(1, p/q), written without a division."""
    return u_accept * q_draft < p_draft


def _residual(p_row: torch.Tensor, cand_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """p_row [N, V], cand_row [N, K], q_row [N, K] -> max(0, p - q) [N, V] (unnormalized; draws normalize),
    or p itself where that is all zero (p == q up to round-off, where a rejection has probability ~0)."""
    residual = p_row.scatter_add(-1, cand_row, -q_row).clamp_min_(0.0)
    return torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_row)


_draw = sample_from  # module-level name, so the kept mutant tests can replace the draw


def verify_sampled(draft_ids: torch.Tensor,        # [N, γ] long
                   cand_ids: torch.Tensor | None,  # [N, γ, K] long, the candidates q is over; None with q=None
                   q: torch.Tensor | None,         # [N, γ, K] fp32 rows the drafts were drawn from; None = δ at draft
                   p: torch.Tensor,                # [N, γ + 1, V] fp32 target probs (`sampling.target_probs`)
                   u_accept: torch.Tensor,         # [N, γ] uniforms in [0, 1) for the accept tests
                   u_residual: torch.Tensor,       # [N] uniform for the recovered or the bonus draw (one happens)
                   num_drafts: torch.Tensor | None = None,  # [N] long in 0..γ, drafts proposed per request; None = γ
                   ) -> VerifyResult:
    """Speculative sampling over a chain of γ drafts (Leviathan et al. 2023, algorithm 1).

    Draft t is accepted iff u_accept[t] * q_t(x_t) < p_t(x_t). At the first rejection t the recovered token is
    drawn from norm(max(0, p_t - q_t)) (q scattered from its K candidates onto the vocabulary); if all γ are
    accepted the bonus token is drawn from p_γ. Both draws use u_residual. A request that proposed only its first
    num_drafts[n] drafts (a choice made before each draft was drawn, e.g. `selector.draft_confidence`'s cut) tests
    only those, and its bonus is drawn from row num_drafts[n].

    Example (γ = 1, V = 3, K = 2): p = [[0.2, 0.5, 0.3], [...]], candidates [0, 1] with q = [0.6, 0.4], draft 0.
        q(0) = 0.6 > p(0) = 0.2: accepted iff u_accept < 1/3. With u_accept = 0.5 it is rejected and the
        recovered token comes from max(0, p - q) = [0, 0.1, 0.3] -> [0, 0.25, 0.75]: u_residual = 0.1 gives
        token 1, so tokens = [1, -1], num_accepted = 0.
    """
    assert draft_ids.ndim == 2 and p.ndim == 3, (draft_ids.shape, p.shape)
    n, gamma = draft_ids.shape
    assert p.shape[:2] == (n, gamma + 1), (draft_ids.shape, p.shape)
    assert u_accept.shape == (n, gamma) and u_residual.shape == (n,), (u_accept.shape, u_residual.shape)
    if q is None:  # a deterministic path: one candidate per slot (the draft) with probability 1
        cand_ids, q = draft_ids.unsqueeze(-1), torch.ones(n, gamma, 1, dtype=torch.float32, device=p.device)
    assert cand_ids is not None, "cand_ids are needed to place q on the vocabulary"
    assert cand_ids.shape == q.shape and q.shape[:2] == (n, gamma), (cand_ids.shape, q.shape)

    q_draft = (q * (cand_ids == draft_ids.unsqueeze(-1))).sum(-1)  # [N, γ] q_t(x_t)
    p_draft = p[:, :gamma].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)  # [N, γ] p_t(x_t)
    num_accepted = _prefix_length(_accepted(u_accept, q_draft, p_draft), num_drafts)

    # One draw per request at row num_accepted. A row past the proposed drafts (row γ, or num_drafts[n]) gets an
    # all-zero q, so its "residual" is p: the bonus.
    rows = torch.arange(n, device=p.device)
    q_row = torch.cat([q, q.new_zeros(n, 1, q.shape[-1])], dim=1)[rows, num_accepted]  # [N, K]
    if num_drafts is not None:
        q_row = q_row * (num_accepted < num_drafts).unsqueeze(1)
    cand_row = torch.cat([cand_ids, cand_ids.new_zeros(n, 1, cand_ids.shape[-1])], dim=1)[rows, num_accepted]
    last = _draw(_residual(p[rows, num_accepted], cand_row, q_row), u_residual)
    return _emit(draft_ids, num_accepted, last)
