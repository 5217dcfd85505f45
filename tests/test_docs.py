"""The command lines in README.md and docs/ parse: every flag they show exists and takes the value shown."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from test_cli import MAINS, ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "plugins").glob("*/README.md"))]
COMMAND = re.compile(r"\bpython3?\s+((?:scripts|build|runtime)/\w+\.py)\b(.*)")
PLACEHOLDER = re.compile(r"\.\.\.|\[|\{|\$")  # a usage pattern (`[--tp 4]`, `{nvfp4,fp8}`, `...`, `$b`), not a command


def commands() -> list[tuple[str, str, str]]:
    """(doc:line, script, arguments) for every script command in the docs' code blocks (continuations joined)."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in re.finditer(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
            first = text.count("\n", 0, block.start(1)) + 1
            lines = block.group(1).split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i]
                i += 1
                m = COMMAND.search(line.split(" #")[0])
                if m and not PLACEHOLDER.search(m.group(2)):
                    found.append((f"{doc.relative_to(ROOT)}:{first + start}", m.group(1), m.group(2).strip()))
    return found


class Parsed(Exception):
    pass


def test_the_docs_show_commands():
    scripts = {script for _, script, _ in commands()}
    assert len(commands()) >= 40 and {"build/build_engines.py", "runtime/run.py", "scripts/benchmark.py",
                                      "scripts/train_drafter.py", "scripts/export_triton.py"} <= scripts


def test_the_files_make_test_starts_first_exist():
    """README: `make test` starts the files that take minutes first (conftest.SLOW_FILES); a renamed one would not
    be."""
    from conftest import SLOW_FILES

    assert [name for name in SLOW_FILES if not (ROOT / "tests" / name).is_file()] == []


@pytest.mark.parametrize("where, script, args", commands(), ids=[where for where, _, _ in commands()])
def test_a_documented_command_parses(where, script, args, monkeypatch, capsys):
    parse = argparse.ArgumentParser.parse_args

    def parse_only(self, argv=None, namespace=None):
        parse(self, argv, namespace)  # a flag it does not know or a bad value exits 2 with argparse's message
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    if script in MAINS:
        main = importlib.import_module(MAINS[script]).main
    else:  # scripts/triton_client.py runs without beamtrt installed: loaded from its file
        spec = importlib.util.spec_from_file_location("doc_" + Path(script).stem, ROOT / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        main = module.parse_args
    try:
        main(shlex.split(args))
    except Parsed:
        return
    except SystemExit as e:
        if e.code == 0 and "--help" in args:
            return
        pytest.fail(f"{where}: {script} {args}: {capsys.readouterr().err.strip()}")
    pytest.fail(f"{where}: {script} {args}: never parsed its arguments")
