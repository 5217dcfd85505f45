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


MARGIN = 8  # characters a tail's start may differ by (a split character's up to 3 U+FFFD, a dropped space), and more


def completed_by(decode, before: list[int], new: list[int], stops) -> int | None:
    """How many of `new` token ids to keep when they complete a stop string in the text `decode` gives (up to the
    completing token), else None. No stop string is in the text of `before` (it would have ended the request), so one
    that `new` completes ends in new text: only a tail of `before` long enough to hold the rest of it is decoded, not
    the whole output each step. A tail's first characters may differ from the whole text's (a character split across
    tokens, a leading space dropped), so the tail holds MARGIN characters more than the longest stop, and only a match
    that ends in the new text counts."""
    longest = max(map(len, stops))
    width = longest + MARGIN  # tokens; ones of no text (special tokens) can make that too few characters: doubled
    while width < len(before) and len(decode(before[-width:])) < longest + MARGIN:
        width *= 2
    tail = before[-width:]
    settled = len(decode(tail).rstrip("\ufffd"))  # a trailing character still missing bytes may change

    def completes(j: int) -> bool:
        text = decode(tail + new[:j])
        return any(text.find(s, max(0, settled - len(s) + 1)) != -1 for s in stops if s)

    if not completes(len(new)):
        return None
    return next(j for j in range(1, len(new) + 1) if completes(j))
