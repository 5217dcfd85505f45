"""Stop strings in decoded text: where the first one starts, and where an ending that could still become one starts."""

from __future__ import annotations


def first_stop(text: str, stops) -> int:
    """Where the earliest stop string starts in `text`; len(text) when none occurs."""
    return min((text.index(s) for s in stops if s in text), default=len(text))


def held_from(text: str, stops) -> int:
    """Where the earliest ending of `text` that is a proper prefix of a stop string starts (more tokens could still
    complete it, so a stream holds the text from there back); len(text) when there is none. Only the last
    len(stop) - 1 characters are looked at, and only where the stop's first character occurs, so long stop lists
    cost little per call."""
    start = len(text)
    for s in stops:
        if not s:
            continue
        i = text.find(s[0], max(0, len(text) - len(s) + 1))
        while i != -1 and i < start:
            if s.startswith(text[i:]):
                start = i
                break
            i = text.find(s[0], i + 1)
    return start
