"""Statistics shared by the exactness tests: a TV limit with a false-alarm bound, chi-square, and wrong verifiers."""

from __future__ import annotations

import math

import torch

ALPHA = 1e-6  # false-alarm probability allowed to each statistical check (the tests are seeded: deterministic)


def tv_limit(p: torch.Tensor, n: int) -> float:
    """The TV an exact sampler of law p stays below with probability >= 1 - ALPHA after n draws.

    E[TV] <= sum sqrt(p (1 - p) / n) / 2 (Jensen), and one draw moves TV by at most 1/n, so McDiarmid adds
    sqrt(ln(1/ALPHA) / 2n).
    """
    p = p.double()
    return 0.5 * float((p * (1 - p)).sqrt().sum()) / math.sqrt(n) + math.sqrt(math.log(1 / ALPHA) / (2 * n))


def law_stats(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float, float]:
    """counts [C] of n iid draws, p [C] the claimed law -> (TV, TV limit, chi-square p-value).

    Chi-square over the cells with expected count >= 5, the others pooled into one cell; a draw in a cell of
    probability 0 gives p-value 0.
    """
    counts, p = counts.double(), p.double()
    n = float(counts.sum())
    tv = 0.5 * float((counts / n - p).abs().sum())
    limit = tv_limit(p, int(n))
    if counts[p == 0].sum() > 0:
        return tv, limit, 0.0
    big = p * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected = torch.cat([p[big], p[~big].sum().view(1)]) * n
    keep = expected > 0
    chi2 = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = int(keep.sum()) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    return tv, limit, p_value


# ---- wrong verifiers (kept as tests): each breaks one rule of speculative sampling ------------------------------

def _accept_with_scaled_q(u_accept, q_draft, p_draft):  # accepts with min(1, p / 1.5q): q off by a factor
    return u_accept * (1.5 * q_draft) < p_draft


def _residual_is_p(p_row, cand_row, q_row):  # recovered tokens drawn from p instead of norm(max(0, p - q))
    return p_row


def _draw_unnormalized(probs, uniform):  # inverse CDF that assumes the residual sums to 1: overflow to the last id
    ids = torch.searchsorted(probs.cumsum(-1), uniform.unsqueeze(-1), right=True).squeeze(-1)
    return ids.clamp_(max=probs.shape[-1] - 1)


# mutant name -> (the private function of beamtrt.spec.verify it replaces, the wrong version)
MUTANTS = {"accept_with_1.5q": ("_accepted", _accept_with_scaled_q),
           "residual_replaced_by_p": ("_residual", _residual_is_p),
           "residual_unnormalized": ("_draw", _draw_unnormalized)}
