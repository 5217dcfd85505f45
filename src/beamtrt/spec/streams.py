"""Per-request random streams: every uniform a request draws is SplitMix64 of its own seed and its draw count, so what
it samples depends on its seed alone, never on the requests drawn with it, and a batch's draws are a few array ops."""

from __future__ import annotations

import math

import numpy as np
import torch

GAMMA, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants
MASK64 = 2**64 - 1
_U64 = {k: np.uint64(k) for k in (GAMMA, MIX1, MIX2, 1, 27, 30, 31, 40)}


def request_seed(seed: int, index: int) -> int:
    """The seed of request `index`'s stream under a decoder's `seed` (SplitMix64 of both), in [0, 2**64)."""
    z = (int(seed) * GAMMA + int(index) + 1) & MASK64  # Python integers (a NumPy scalar would overflow)
    for shift, mul in ((30, MIX1), (27, MIX2)):
        z = ((z ^ (z >> shift)) * mul) & MASK64
    return z ^ (z >> 31)


def uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """seeds [N, 1], counters [N, n] (uint64) -> [N, n] float32 uniforms in [0, 1): the counters[i, j]-th draw of the
    stream seeded by seeds[i] (SplitMix64's output for that state, its top 24 bits, as torch.rand's resolution)."""
    u = _U64  # uint64 array arithmetic wraps, as SplitMix64's does
    z = seeds + (counters + u[1]) * u[GAMMA]
    z = (z ^ (z >> u[30])) * u[MIX1]
    z = (z ^ (z >> u[27])) * u[MIX2]
    z ^= z >> u[31]
    return (z >> u[40]).astype(np.float32) * np.float32(2**-24)


class RequestStreams:
    """The random streams of a decoder's cache slots: seeded when a request is admitted, drawn for many at once."""

    def __init__(self, slots: int):
        self.seed = np.zeros(slots, dtype=np.uint64)   # [slots] its request's stream seed
        self.drawn = np.zeros(slots, dtype=np.uint64)  # [slots] uniforms drawn from it so far

    def start(self, slot: int, seed: int) -> None:
        self.seed[slot], self.drawn[slot] = int(seed) & MASK64, 0

    def draw(self, slots: list[int], *shape: int) -> torch.Tensor:
        """[len(slots), *shape] uniforms, each row the next ones of its slot's stream."""
        n = math.prod(shape)
        at = np.asarray(slots, dtype=np.intp)
        counters = self.drawn[at, None] + np.arange(n, dtype=np.uint64)
        self.drawn[at] += np.uint64(n)
        return torch.from_numpy(uniforms(self.seed[at, None], counters)).reshape(len(slots), *shape)
