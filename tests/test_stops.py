"""Stop strings in decoded text (beamtrt.spec.stops), against their definitions written out longhand."""

from __future__ import annotations

import random

from beamtrt.spec.stops import MARGIN, completed_by, first_stop, held_from


def test_first_stop_and_held_from_match_their_definitions():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab\u00e9") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab\u00e9") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(4))]
        first = min((i for i in range(len(text)) for s in stops if text.startswith(s, i)), default=len(text))
        held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        assert first_stop(text, stops) == first, (text, stops)
        assert held_from(text, stops) == len(text) - held, (text, stops)


def test_completed_by_matches_its_definition_on_byte_tokens():
    """completed_by decodes only a tail of the output; on byte tokens (characters split across tokens, ids >= 256 that
    decode to nothing, as special tokens do) it keeps what decoding the whole output would."""
    def decode(ids):
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    rng = random.Random(1)
    alphabet = [c.encode() for c in "ab \u00e9\u7b54"] + [[256]]
    for _ in range(2000):
        stops = tuple("".join(rng.choice("ab \u00e9\u7b54") for _ in range(rng.randrange(1, 5)))
                      for _ in range(rng.randrange(1, 3)))
        ids = [t for _ in range(rng.randrange(1, 40)) for t in rng.choice(alphabet)]
        cut = rng.randrange(len(ids))
        before, new = ids[:cut], ids[cut:cut + rng.randrange(1, 9)]
        if any(s in decode(before) for s in stops):  # the request would have ended before this step
            continue
        want = next((j for j in range(1, len(new) + 1) if any(s in decode(before + new[:j]) for s in stops)), None)
        assert completed_by(decode, before, new, stops) == want, (before, new, stops)


def test_completed_by_decodes_a_tail():
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return "".join(map(chr, ids))

    assert completed_by(decode, [ord("x")] * 5000, [ord("a"), ord("b")], ("ab",)) == 2
    assert max(seen) <= len("ab") + MARGIN + 2, max(seen)
