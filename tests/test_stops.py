"""Stop strings in decoded text and the streamed text of a request (beamtrt.spec.stops), against their definitions."""

from __future__ import annotations

import random

from beamtrt.spec.stops import MARGIN, TextStream, completed_by, first_stop, held_from, text_delta


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


def test_a_stream_holds_back_what_may_become_a_stop_string():
    """What a stream shows of text so far (one character a token): the text before a stop string, without an ending
    more tokens could still complete into one, nor a character still missing bytes (U+FFFD)."""
    def shown(text: str, stops: tuple[str, ...]) -> str:
        stream = TextStream(lambda ids: "".join(map(chr, ids)), stops, stream=True)
        stream.ids.extend(map(ord, text))
        delta = stream.take(final=False)
        return delta[3] if delta else ""

    assert shown("The capital is Paris.", ("Paris",)) == "The capital is "
    assert shown("The capital is Pa", ("Paris",)) == "The capital is "  # may still become "Paris"
    assert shown("The capital is Pe", ("Paris",)) == "The capital is Pe"  # cannot
    assert shown("a\n\nb", ("\n\n", "b!")) == "a" and shown("ab", ("bc", "x")) == "a"
    assert shown("abc", ()) == "abc"
    assert shown("Hi!\ufffd", ("!\u7b54",)) == "Hi" and shown("ok \ufffd", ()) == "ok "  # bytes to come


def test_streamed_text_keeps_sentencepiece_spaces():
    """A delta's text is decoded after the tokens sent before it: a sentencepiece-style tokenizer drops the leading
    space of a text's first word, so decoding a delta alone would glue the words together."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    sentence = "the quick brown fox jumps over the lazy dog again and again"
    tok.train_from_iterator([sentence] * 5, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"]))
    ids = tok.encode(sentence).ids
    decode = tok.decode
    text = TextStream(decode, (), stream=True)
    pieces = []
    for start in range(0, len(ids), 2):
        text.ids.extend(ids[start:start + 2])
        pieces.append(text.take(final=False))
    pieces.append(text.take(final=True))
    assert "".join(p[3] for p in pieces if p) == decode(ids) == sentence
    assert all(text_delta(decode, p[1], p[0], p[2]) == p[3] for p in pieces if p)


def test_a_stream_holds_back_only_what_could_still_become_a_stop_word():
    """Stop words starting with every letter the output uses (within the documented 64 x 1,024): each step used to
    re-decode its whole unsent text once per candidate end and hold all of it (any text ends in some stop word's first
    letter), so the request streamed nothing and stalled the decode thread for every other request. Now a step sends
    all but the ending that could still grow into a stop word, decoding only its new tokens' ends."""
    calls = []

    def decode(ids):  # one letter per token
        calls.append(len(ids))
        return "".join(chr(97 + i % 26) for i in ids)
    stops = tuple(chr(97 + i) + "\0" * 1023 for i in range(26))
    text = TextStream(decode, stops, stream=True)
    ids = [(7 * i) % 26 for i in range(400)]
    pieces = []
    for start in range(0, len(ids), 4):
        text.ids.extend(ids[start:start + 4])
        pieces.append(text.take(final=False))
    pieces.append(text.take(final=True))
    assert "".join(p[3] for p in pieces if p) == decode(ids)
    assert all(p is not None and len(p[0]) == 4 for p in pieces[1:-1])  # every step but the last token, sent at once
    assert len(calls) <= 8 * len(pieces)  # a few text_delta calls a step (each decodes the context and the delta)

    calls.clear()  # a held-back ending as long as the stop string allows, moving on every step
    text = TextStream(decode, ("a" * 1023 + "b",), stream=True)
    sent = []
    for step in range(600):
        text.ids.extend([0] * 4)  # "aaaa"
        sent.append(text.take(final=False))
    assert sum(len(p[0]) for p in sent if p) == 4 * 600 - 1023  # all but the ending that could still be the stop
    assert len(calls) <= 30 * 600  # bisection: it was 2,048 decodes of up to 1,000 tokens a step

    def utf8(ids):  # one byte per token: a character can be split across tokens
        return bytes(ids).decode("utf-8", errors="replace")
    text = TextStream(utf8, ("!\u7b54",), stream=True)
    streamed = []
    for byte in "Hi!\u7b54".encode():  # the request stops when the stop string's last byte comes
        text.ids.append(byte)
        streamed.append(text.take(final=False))
    last = text.take(final=True)
    assert "".join(p[3] for p in streamed if p) == "Hi"  # "!" waited for the character after it, not just its bytes
    assert last[3] == "" and last[2] == 0  # the final delta holds the stop string, cut before it


def test_a_final_delta_that_opens_with_the_stop_string_sends_no_text():
    """The usual streaming end: the stop string's start was held back, the next token completes it, and the final
    delta's text_end is 0, which postprocessing must read as nothing (read as all, it sent the stop string)."""
    decode = "".join
    text = TextStream(decode, ("STOP",), stream=True)
    text.ids.extend("ab S")
    first = text.take(final=False)
    assert first[3] == "ab "  # "S" held back: it may become "STOP"
    text.ids.extend("TOP")
    last = text.take(final=True)
    assert last[2] == 0 and last[3] == "" and text_delta(decode, last[1], last[0], last[2]) == ""
