"""Repository layout rules: entry folders hold only thin shims, and .gitignore never hides them."""

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ["build/build_engines.py", "runtime/run.py", "scripts/make_beam_mini.py", "scripts/make_random_beam.py"]


@pytest.mark.parametrize("path", SHIMS + ["src/beamtrt/models/beam.py", "README.md", ".ci/run"])
def test_sources_are_not_gitignored(path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
    assert proc.returncode == 1, f"{path} is ignored by .gitignore"


def test_gitignore_patterns_are_anchored():
    for line in (ROOT / ".gitignore").read_text().splitlines():
        if line and not line.startswith("#"):
            assert line.startswith(("/", "**/")), f"unanchored .gitignore pattern: {line}"


@pytest.mark.parametrize("folder", ["build", "runtime"])
def test_entry_folders_are_not_packages(folder):
    assert sorted(p.name for p in (ROOT / folder).iterdir() if p.suffix == ".py") in (["build_engines.py"], ["run.py"])
    assert not (ROOT / folder / "__init__.py").exists()


@pytest.mark.parametrize("path", SHIMS)
def test_shims_only_import_the_package(path):
    tree = ast.parse((ROOT / path).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"sys", "pathlib", "beamtrt"}
    assert ast.get_docstring(tree)
