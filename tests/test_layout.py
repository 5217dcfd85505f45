"""Repository layout rules: entry folders hold only thin shims, and .gitignore never hides them."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIMS = ["build/build_engines.py", "runtime/run.py", "scripts/make_beam_mini.py", "scripts/make_random_beam.py"]
# a checkout git reads: git installed, a .git here, and one git trusts (not another user's: "dubious ownership")
needs_git = pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None or subprocess.run(
    ["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode != 0,
    reason="not a git checkout git can read")


@pytest.mark.parametrize("path", SHIMS + ["src/beamtrt/models/beam.py", "README.md", ".ci/run"])
@needs_git
def test_sources_are_not_gitignored(path):
    proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
    assert proc.returncode == 1, f"{path} is ignored by .gitignore"


@pytest.mark.parametrize("name", ["beam-mini", "rb"])  # train_drafter.py --target rb: checkpoints/rb-dflash2-*
@needs_git
def test_training_outputs_are_gitignored_for_any_target(name):
    """A feature cache's taps, the training state and the trained drafter stay out of `git status` whatever the
    target; a cache's meta.json and answers files (small, committed) do not."""
    ignored = [f"{name}-dflash2-data/features-00000.safetensors", f"{name}-dflash2-data-s6/features-00000.safetensors",
               f"{name}-dflash2-data/features-00001.safetensors.tmp", f"{name}-dflash2-train/train_state.pt",
               f"{name}-dflash2-trained/model.safetensors"]
    kept = [f"{name}-dflash2-data/meta.json", f"{name}-dflash2-data/answers-00000.safetensors"]
    for path in ignored + kept:
        proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", f"checkpoints/{path}"], cwd=ROOT)
        assert proc.returncode == (0 if path in ignored else 1), path


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


@needs_git
def test_a_wheel_built_from_the_checkout_is_ignored():
    """`pip install .` leaves setuptools' build/lib and build/bdist.* in the checkout (and `python -m build`, dist/):
    they showed as untracked files beside build/build_engines.py."""
    for path in ("build/lib/beamtrt/config.py", "build/bdist.linux-x86_64/wheel", "dist/beamtrt-0.1.0.tar.gz"):
        proc = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert proc.returncode == 0, f"{path} is not ignored"


def test_make_lists_its_targets_and_refuses_an_old_python_in_one_line():
    """`make help` was no target; `make setup` with a PYTHON that is missing (or older than 3.10) printed shell
    errors, or made a .venv of it and failed in pip's resolver."""
    import os

    if shutil.which("make") is None:
        pytest.skip("no make")
    # as from a shell: under `make test` the make it starts would say "Entering directory" (MAKELEVEL > 0)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    listed = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert listed.returncode == 0 and [line.split()[0] for line in listed.stdout.splitlines()] == [
        "setup", "help", "run", "test", "test-fast", "bench-setup"], listed.stdout
    # -B: the recipe runs even where .venv is up to date; its first line stops it before anything is made
    proc = subprocess.run(["make", "-B", "setup", "PYTHON=/nonexistent/python3"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.splitlines()[0] == (
        "error: make setup needs Python 3.10 or newer as PYTHON (/nonexistent/python3 is no Python): make setup "
        "PYTHON=/path/to/python3.11"), proc.stderr
    proc = subprocess.run(["make", "-B", "setup", f"PYTHON={sys.executable}",  # this one: python3 may be older
                           "TORCH_INDEX=https://download.pytorch.org/whl/cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)  # the URL without its --index-url
    assert proc.returncode == 2 and proc.stderr.splitlines()[0].startswith(
        "error: TORCH_INDEX is pip's options for torch's index, e.g. TORCH_INDEX=\"--index-url "), proc.stderr
