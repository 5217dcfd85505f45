"""Stop strings in decoded text (where the first one starts, where an ending that could still become one starts) and the
streamed text of a request, held back where a stop string could still come."""

from __future__ import annotations

from typing import Callable


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


CONTEXT_TOKENS = 8  # tokens sent before a delta that its text is decoded after (leading-space / byte-merge rules)


def text_delta(decode: Callable[[list[int]], str], context_ids, new_ids, end: int = -1) -> str:
    """The text `new_ids` add after `context_ids` (the tokens sent just before them), cut to `end` chars (-1: all)."""
    context = list(context_ids)
    before = decode(context) if context else ""
    text = decode(context + list(new_ids))[len(before):]
    return text if end < 0 else text[:end]


class TextStream:
    """One request's committed tokens and how many were sent. A streamed delta ends where its text is settled: not
    in the middle of a UTF-8 character (U+FFFD at the end), and not past where the unsent text's settled part ends in
    what could still grow into a stop string, so a stop string always lies inside the final delta, which is cut
    before it. For as long as `sent` stays, the text of each candidate end is decoded once, and the largest end that
    fits is found by bisection (text grows with its tokens), so a step decodes a few ends however long the stop
    list or the held-back ending."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...], stream: bool):
        self.decode, self.stops, self.stream = decode, stops, stream
        self.ids: list[int] = []
        self.sent = 0  # tokens already sent
        self._texts: dict[int, str] = {}  # end -> the text of ids[sent:end] after the context, while `sent` stays

    def take(self, final: bool) -> tuple[tuple[int, ...], tuple[int, ...], int, str] | None:
        """(token_ids, context_ids, text_end, text) of the next delta; None when nothing new is settled."""
        if not (final or self.stream):
            return None
        context = self.ids[max(0, self.sent - CONTEXT_TOKENS):self.sent]
        end = len(self.ids) if final else self._settled(context)
        if end == self.sent and not final:
            return None
        new = self.ids[self.sent:end]
        text = self._text(context, end)
        cut = first_stop(text, self.stops) if final else len(text)
        self.sent, self._texts = end, {}
        return tuple(new), tuple(context), cut if cut < len(text) else -1, text[:cut]

    def _text(self, context: list[int], end: int) -> str:
        if end not in self._texts:
            self._texts[end] = text_delta(self.decode, context, self.ids[self.sent:end])
        return self._texts[end]

    def _settled(self, context: list[int]) -> int:
        full = self._text(context, len(self.ids))
        stable = full.rstrip("\ufffd")  # a character still missing bytes: what follows it is not known yet
        limit = min(first_stop(stable, self.stops), held_from(stable, self.stops))
        low, high = self.sent, len(self.ids)  # the largest end whose text fits within `limit`
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if len(self._text(context, mid)) <= limit else (low, mid - 1)
        for end in range(low, self.sent, -1):
            text = self._text(context, end)
            if len(text) <= limit and full.startswith(text) and not text.endswith("\ufffd"):
                return end
        return self.sent
