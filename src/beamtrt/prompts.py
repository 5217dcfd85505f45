"""Prompt files: JSONL with one {"prompt": "..."} or {"messages": [{"role", "content"}, ...]} per line."""

from __future__ import annotations

import json
from pathlib import Path

from beamtrt.errors import BeamtrtError


def read_chats(path: str | Path) -> list[list[dict]]:
    """Chats from a JSONL file; each line {"prompt": str} or {"messages": [{"role", "content"}, ...]}."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
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
