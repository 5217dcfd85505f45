"""Stop strings in decoded text (beamtrt.spec.stops), against their definitions written out longhand."""

from __future__ import annotations

import random

from beamtrt.spec.stops import first_stop, held_from


def test_first_stop_and_held_from_match_their_definitions():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab\u00e9") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab\u00e9") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(4))]
        first = min((i for i in range(len(text)) for s in stops if text.startswith(s, i)), default=len(text))
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        assert first_stop(text, stops) == first, (text, stops)
        assert held_from(text, stops) == len(text) - held, (text, stops)
