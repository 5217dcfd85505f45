"""Prompt files (JSONL, one {"prompt": "..."} or {"messages": [{"role", "content"}, ...]} per line) and the
checkpoint tokenizer that encodes them."""

from __future__ import annotations

import json
from pathlib import Path

from beamtrt.cli_util import error_line
from beamtrt.errors import BeamtrtError, CheckpointError


def load_tokenizer(path: str | Path):
    """A checkpoint's tokenizer (transformers' AutoTokenizer), or one line naming the folder: missing or damaged files
    raise many kinds of errors there (a model folder without tokenizer files: a TypeError)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({error_line(e)}); a checkpoint needs its "
                              "tokenizer files (tokenizer.json, tokenizer_config.json)") from None


def read_chats(path: str | Path) -> list[list[dict]]:
    """Chats from a JSONL file; each line {"prompt": str} or {"messages": [{"role", "content"}, ...]}."""
    try:
        lines = Path(path).read_text(encoding="utf-8").split("\n")  # JSON strings may hold U+2028 and the like
    except (OSError, UnicodeDecodeError) as e:
        raise BeamtrtError(f"{path}: cannot read the prompts file ({e.__class__.__name__})") from None
    chats = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BeamtrtError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise BeamtrtError(f"{path}:{n}: JSON nested too deeply") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            chats.append([{"role": "user", "content": obj["prompt"]}])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in obj["messages"]) and obj["messages"]:
            chats.append(obj["messages"])
        else:
            raise BeamtrtError(f'{path}:{n}: expected {{"prompt": str}} or {{"messages": [{{"role", "content"}}]}}')
    if not chats:
        raise BeamtrtError(f"{path}: no prompts")
    return chats
