"""Prompt files (JSONL, one {"prompt": "..."} or {"messages": [{"role", "content"}, ...]} per line) and the
checkpoint tokenizer that encodes them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from beamtrt.cli_util import error_line
from beamtrt.errors import BeamtrtError, CheckpointError


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(path: str | Path) -> bool:
    """Whether a model folder holds tokenizer files (any of TOKENIZER_FILES), without loading them."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path):
    """A checkpoint's tokenizer (transformers' AutoTokenizer), or one line naming the folder: missing or damaged files
    raise many kinds of errors there (a model folder without tokenizer files: a list of every model type)."""
    from transformers import AutoTokenizer

    if Path(path).is_dir() and not has_tokenizer(path):
        raise CheckpointError(f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}) to encode prompts "
                              "with: copy the model's tokenizer files into it (a build copies its source model's: add "
                              "them there and rebuild)")
    try:
        str(path).encode()
    except UnicodeEncodeError:  # the tokenizer library takes only UTF-8 paths (the folder is fine otherwise)
        raise CheckpointError(f"{path}: the tokenizer library opens only UTF-8 paths; rename the folder whose name is "
                              "not UTF-8") from None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        line = error_line(e)
        line = line if len(line) <= 200 else line[:200] + " ..."  # transformers may list every model type
        raise CheckpointError(f"{path}: cannot load the tokenizer ({line}); a checkpoint needs its tokenizer files "
                              "(tokenizer.json, tokenizer_config.json)") from None


ROLES = ("system", "user", "assistant", "tool")  # a chat message's roles, as chat templates know them


def render_chat(tokenizer, chat: list[dict]) -> list[int]:
    """One chat through the tokenizer's chat template, the assistant turn opened. A chat the template rejects (roles out
    of its order, a template that raises, a tokenizer without one) is a one-line ValueError: "the chat template
    rejected it (why)"."""
    try:
        return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True))
    except Exception as e:  # jinja2's TemplateError, transformers' ValueError for a tokenizer without a template
        raise ValueError(f"the chat template rejected it ({error_line(e)})") from None


def render_chats(tokenizer, chats: list[list[dict]], where: list[str]) -> list[list[int]]:
    """render_chat for each chat; a chat the template rejects is a BeamtrtError naming where it came from (`where`, one
    per chat)."""
    ids = []
    for chat, place in zip(chats, where):
        try:
            ids.append(render_chat(tokenizer, chat))
        except ValueError as e:
            raise BeamtrtError(f"{place}: {e}") from None
    return ids


def make_decode(tokenizer) -> Callable[[list[int]], str]:
    """Token ids -> text, as generated: no clean-up of spaces, which rewrites what the model wrote (`print("Hi !")`
    -> `print("Hi!")`) and text already streamed (" ." -> ".")."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def special_stops(tokenizer, stops, what: str = "--stop") -> tuple[frozenset[int], tuple[str, ...]]:
    """Stop strings that are one special token (`<|im_start|>`) stop on that token: text is decoded without special
    tokens, where such a string never appears. Returns (their token ids, the other stop strings). A stop string that
    holds a special token among other text could never match, and one that holds U+FFFD would match the half of a
    character that the text shows as U+FFFD until its last byte comes: a ValueError naming it (`what` names the
    field)."""
    for s in stops:
        if "\ufffd" in s:
            raise ValueError(f"{what} {s!r} holds U+FFFD, which the decoded text shows in place of a character whose "
                             "bytes have not all come yet, so it would stop in the middle of one: leave it out")
    added = tokenizer.get_added_vocab()
    special = {t: i for t, i in added.items() if any(t in s for s in stops)  # decoded only when a stop holds it
               and tokenizer.decode([i], skip_special_tokens=True) == ""}
    for s in stops:
        inside = next((t for t in special if t in s and t != s), None)
        if inside is not None:
            raise ValueError(f"{what} {s!r} holds the special token {inside}, which the decoded text never shows, so "
                             f"it could never match: give {inside} as a stop string of its own")
    ids = {s: special[s] for s in stops if s in special}
    return frozenset(ids.values()), tuple(s for s in stops if s not in ids)


def utf8_text(text: str, where: str) -> str:
    """`text` if it is valid Unicode; else one line: non-UTF-8 bytes on the command line (Python holds them as
    surrogate escapes) or a lone surrogate \\uXXXX escape in a JSON string, which the tokenizer cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BeamtrtError(f"{where}: not valid UTF-8 text (character {e.start + 1}); give text as UTF-8") from None
    return text


def _opens(messages, prompt) -> bool:
    """Whether a chat's first message is the user turn `prompt` (as in exports that give a prompt and its chat)."""
    return isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict) and (
        messages[0].get("role"), messages[0].get("content")) == ("user", prompt)


@dataclass(frozen=True)
class Layout:
    """An official set's line layout, read beside {"prompt"} and {"messages"} lines: a line holding `marker` is one,
    unless it holds "messages", or a "prompt" the layout does not read (those are taken as they are); `prompt` makes
    its user prompt from it and `later` its later user turns, each asked after the answer to the one before (both None
    where its fields are not as `needs` says)."""

    name: str  # the set, for messages: "GSM8K"
    marker: str  # the field that marks the layout: "question"
    needs: str  # its fields as the message names them: '"question": a non-empty str'
    prompt: Callable[[dict], str | None]
    reads_prompt: bool = False  # its own text is in "prompt" (HumanEval)
    later: Callable[[dict], tuple[str, ...] | None] = lambda obj: ()  # MT-Bench's second turn

    def holds(self, obj: dict) -> bool:
        return self.marker in obj and "messages" not in obj and ("prompt" not in obj or self.reads_prompt)


def read_chat_lines(path: str | Path) -> list[tuple[int, list[dict]]]:
    """Chats from a JSONL file (UTF-8, a BOM allowed), each with the number of the line it is on (for messages about
    one of them); each line {"prompt": str} or {"messages": [{"role", "content"}, ...]}: a line with both is read as
    its prompt when its messages open with it (a dataset export), and refused otherwise; other fields are ignored (an
    official set's task_id, canonical_solution, ...)."""
    return [(n, chat) for n, chat, _ in read_conversations(path)]


def read_conversations(path: str | Path, layout: Layout | None = None
                       ) -> list[tuple[int, list[dict], tuple[str, ...]]]:
    """read_chat_lines, and with a `layout` its lines too (Layout.holds), each chat with the user turns that follow
    its answer (Layout.later; none for the other lines)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:  # '-' is no file either: standard input has its own path
        raise BeamtrtError(f"{path}: cannot read the prompts file (no such file" + (
            "; for standard input give /dev/stdin)" if str(path) == "-" else ")")) from None
    except OSError as e:
        raise BeamtrtError(f"{path}: cannot read the prompts file ({e.strerror})") from None
    try:
        lines = data.decode("utf-8-sig").split("\n")  # JSON strings may hold U+2028 and the like
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise BeamtrtError(f"{path}:{line}: not UTF-8 text (byte offset {e.start}); a prompts file must be UTF-8"
                           ) from None
    one_per_line = "a prompts file is JSON Lines: one object per line"
    chats, numbers, later = [], [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BeamtrtError(f"{path}:{n}: not valid JSON ({e.msg}); {one_per_line}") from None
        except RecursionError:
            raise BeamtrtError(f"{path}:{n}: JSON nested too deeply") from None
        except ValueError as e:  # valid JSON Python will not read: an integer of over 4,300 digits
            raise BeamtrtError(f"{path}:{n}: {error_line(e)}") from None
        both = isinstance(obj, dict) and "prompt" in obj and "messages" in obj
        if both and not _opens(obj["messages"], obj["prompt"]):
            raise BeamtrtError(f'{path}:{n}: holds both "prompt" and "messages", and the messages do not open with '
                               "that prompt; give one")  # which was meant? (a dataset export's two copies agree)
        turns = ()
        if layout is not None and isinstance(obj, dict) and layout.holds(obj):
            if (prompt := layout.prompt(obj)) is None or (turns := layout.later(obj)) is None:
                raise BeamtrtError(f"{path}:{n}: this {layout.name} line (it has {layout.marker!r}) needs "
                                   f"{layout.needs}")
            chats.append([{"role": "user", "content": prompt}])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            chats.append([{"role": "user", "content": obj["prompt"]}])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in obj["messages"]) and obj["messages"]:
            if stray := [m["role"] for m in obj["messages"] if m["role"] not in ROLES]:  # a typo ("usr") was
                raise BeamtrtError(f"{path}:{n}: role {stray[0]!r} is not one of {', '.join(ROLES)}")  # rendered as is
            chats.append(obj["messages"])
        else:
            expected = '{"prompt": str} or {"messages": [{"role", "content"}]}' + (
                f" or a {layout.name} line ({layout.needs})" if layout else "")
            keys = f" (its fields: {', '.join(map(str, obj))})" if isinstance(obj, dict) and obj else ""
            raise BeamtrtError(f"{path}:{n}: expected {expected}{keys}; {one_per_line}")
        numbers.append(n)
        later.append(turns)
        for text in [message["content"] for message in chats[-1]] + list(turns):
            utf8_text(text, f"{path}:{n}")
    if not chats:
        raise BeamtrtError(f"{path}: no prompts")
    return list(zip(numbers, chats, later))
