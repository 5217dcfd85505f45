"""The entry scripts: --help documents every flag; bad input gives one line and exit code 2; run.py generates.

Flag and error checks call each script's `main` in this process (a fresh interpreter per call would spend most of
the suite's time importing torch); `test_scripts_call_these_mains` pins each script to its module, and the
subprocess tests below run real scripts end to end.
"""

import errno
import importlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from beamtrt.config import BeamConfig, DrafterConfig
from conftest import TINY, written_by_another_process

ROOT = Path(__file__).resolve().parents[1]
MAINS = {
    "runtime/run.py": "beamtrt.runtime.cli", "build/build_engines.py": "beamtrt.build.cli",
    "scripts/make_beam_mini.py": "beamtrt.models.beam_mini_cli",
    "scripts/make_random_beam.py": "beamtrt.models.random_beam_cli",
    "scripts/bench_decode.py": "beamtrt.bench.decode", "scripts/bench_spec.py": "beamtrt.bench.spec",
    "scripts/bench_convert.py": "beamtrt.bench.convert", "scripts/bench_tp.py": "beamtrt.bench.tp",
    "scripts/benchmark.py": "beamtrt.bench.benchmark", "scripts/train_drafter.py": "beamtrt.train.cli",
    "scripts/bench_kernels.py": "beamtrt.bench.kernels", "scripts/export_triton.py": "beamtrt.triton.cli",
    "scripts/eval_drafter.py": "beamtrt.train.eval_cli", "scripts/draft_vocab.py": "beamtrt.train.vocab_cli",
}
STANDALONE = {"scripts/triton_client.py"}  # runs on a client machine with tritonclient only (no beamtrt, no torch)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys):
    """run(script, *args) -> Result: the script's main() in this process, its exit code and output."""
    def call(script: str, *args: str) -> Result:
        try:
            rc = importlib.import_module(MAINS[script]).main(list(args))
        except SystemExit as e:  # argparse: --help, or a flag it rejects itself
            rc = e.code
        out = capsys.readouterr()
        return Result(rc, out.out, out.err)
    return call


def run_script(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_scripts_call_these_mains():
    for script, module in MAINS.items():
        assert f'sys.exit(run("{module}"))' in (ROOT / script).read_text(), script
    assert sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("scripts/*.py"), ROOT / "runtime/run.py",
                                                      ROOT / "build/build_engines.py"]) == sorted([*MAINS, *STANDALONE])


@pytest.mark.parametrize("sig, ending", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")])
def test_a_signal_during_the_start_up_imports_ends_as_one_later_would(tmp_path, sig, ending):
    """Ctrl-C in the second torch and transformers take to import was a traceback, or an abort inside torch's C++
    (exit -6): a command's imports hold it, then end with the same line and status as the command would later."""
    (tmp_path / "slow_cli.py").write_text(
        "import sys, time\nprint('importing', flush=True)\ntime.sleep(3)\n"
        "def main():\n    print('main ran')\n    return 0\n")
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'src')!r}, {str(tmp_path)!r}]\n"
            "from beamtrt.entry import run\nsys.exit(run('slow_cli'))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal has it
    assert proc.stdout.readline() == "importing\n"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, err, out) == (128 + sig, f"{ending}\n", "")
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (quiet.returncode, quiet.stdout) == (0, "importing\nmain ran\n")  # and main runs when nothing came


def test_validate_module_holds_a_signal_during_its_imports(tmp_path):
    """`python -m beamtrt.checkpoint.validate` has no script: run as __main__ it goes through beamtrt.entry too, so
    Ctrl-C while torch imports ends in `interrupted` and 130 (it was a KeyboardInterrupt traceback)."""
    code = ("import os, runpy, signal, sys, threading, time\n"
            f"sys.path[:0] = [{str(ROOT / 'src')!r}]; sys.argv = ['validate', {str(tmp_path / 'none')!r}]\n"
            "def ctrl_c():  # once the imports hold signals (a fixed delay could land before that on a busy host)\n"
            "    while signal.getsignal(signal.SIGINT) is signal.default_int_handler:\n"
            "        time.sleep(0.001)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "threading.Thread(target=ctrl_c, daemon=True).start()\n"
            "runpy.run_module('beamtrt.checkpoint.validate', run_name='__main__', alter_sys=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "interrupted\n", "")


def assert_one_line_error(proc: Result, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize("script, flags", [
    ("runtime/run.py", ["--engine-dir", "--concurrency", "--model", "--drafter", "--prompt", "--prompts",
                        "--max-new-tokens", "--temperature",
                        "--top-p", "--top-k", "--stop", "--block-size", "--draft-threshold", "--no-spec", "--seed",
                        "--json", "--backend",
                        "--dtype", "--device",
                        "--threads", "--quiet"]),
    ("scripts/make_beam_mini.py", ["--out", "--num-experts", "--top-k", "--perturbation", "--dtype", "--seed",
                                   "--force"]),
    ("scripts/make_random_beam.py", ["--out", "--hidden-size", "--layers", "--experts", "--top-k", "--dtype",
                                     "--max-shard-gb"]),
    ("build/build_engines.py", ["--precision", "--model", "--drafter", "--tp", "--moe-ep", "--kv-cache",
                                "--drafter-precision", "--calib-prompts", "--calib-samples", "--out", "--force",
                                "--quiet", "--max-batch-size", "--max-seq-len", "--max-num-tokens", "--block-size",
                                "--tensorrt-root"]),
    ("scripts/bench_decode.py", ["--model", "--dtypes", "--batches", "--context", "--steps", "--paths", "--threads",
                                 "--json"]),
    ("scripts/bench_spec.py", ["--model", "--drafter", "--batches", "--block-size", "--draft-threshold",
                               "--max-new-tokens", "--dtype",
                               "--threads", "--json"]),
    ("scripts/benchmark.py", ["--model", "--drafter", "--families", "--prompts", "--num-prompts", "--c1-prompts",
                              "--concurrency", "--max-new-tokens", "--block-size", "--draft-threshold", "--no-block16",
                              "--dtype",
                              "--threads", "--out", "--engine-dir", "--backend", "--device"]),
    ("scripts/train_drafter.py", ["--target", "--data", "--work", "--out", "--prompts", "--max-new-tokens",
                                  "--gen-batch", "--data-seed", "--steps", "--seqs-per-step", "--anchors",
                                  "--block-size", "--eval-block-size", "--lr", "--gamma", "--selector-weight", "--seed",
                                  "--eval-every", "--checkpoint-every", "--layers", "--selector-rank", "--threads",
                                  "--quiet", "--extra-data", "--data-only", "--init", "--prompt-mix",
                                  "--skip-answered-in", "--head-vocab", "--device"]),
    ("scripts/bench_kernels.py", ["--repeats", "--json"]),
    ("scripts/eval_drafter.py", ["--data", "--drafter", "--target", "--per-kind", "--block-size", "--device",
                                 "--threads", "--json"]),
    ("scripts/draft_vocab.py", ["drafter", "--data", "--eval-sequences", "--target", "--force"]),
])
def test_help_lists_every_flag(script, flags, run):
    proc = run(script, "--help")
    assert proc.returncode == 0
    for flag in flags:
        assert flag in proc.stdout
    description = " ".join(proc.stdout.split("\n\n")[1].split())  # the paragraph after usage: whole sentences
    assert description.endswith("."), description


def test_help_and_errors_print_once_under_mpirun(run, monkeypatch):
    """Every rank parses the same arguments: rank 0 alone prints --help (it printed once per rank) or an error."""
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
        helped, refused = run("runtime/run.py", "--help"), run("runtime/run.py", "--top-k", "many")
        assert (helped.returncode, refused.returncode) == (0, 2)
        assert ("--engine-dir" in helped.stdout, "error: " in refused.stderr) == (printed, printed)
        assert printed or helped.stdout == refused.stderr == ""


def test_gpu_check_help_and_bad_argument():
    """gpu_check.sh takes no arguments: --help explains it without building anything, anything else is refused, and
    without a GPU it says so at once; gpu_host_check.sh's flags need values."""
    script = str(ROOT / "scripts/gpu_check.sh")
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "Usage: scripts/gpu_check.sh" in proc.stdout and "CMake" in proc.stdout
    assert "==" not in proc.stdout  # no stage ran
    assert_one_line_error(subprocess.run([script, "--tp", "4"], capture_output=True, text=True, timeout=30),
                          "takes no arguments", "--tp")
    if not torch.cuda.is_available():  # says so at once instead of building for minutes
        assert_one_line_error(subprocess.run([script], capture_output=True, text=True, timeout=60,
                                             env={**os.environ, "PY": sys.executable}), "no CUDA device")
        if (ROOT / ".venv/bin/python").is_file():  # the Python it picks: it said "python3 has no torch" here
            env = {k: v for k, v in os.environ.items() if k != "PY"}
            assert_one_line_error(subprocess.run([script], capture_output=True, text=True, timeout=120, env=env),
                                  ".venv/bin/python's torch sees no CUDA device: this check needs a GPU host")
    host = str(ROOT / "scripts/gpu_host_check.sh")
    for args, needle in ((["--tp"], "--tp needs a value"), (["--tp", "x"], "positive integer"),
                         (["--bogus"], "unknown argument"), (["--precisions", ""], "--precisions: an empty value"),
                         (["--precisions", "bf16,fp8"], "unknown precision 'bf16,fp8'"),  # before any build
                         (["--precisions", " "], "--precisions: no precision given")):
        assert_one_line_error(subprocess.run([host, *args], capture_output=True, text=True, timeout=30), needle)
    assert "set -euo" not in subprocess.run([host, "--help"], capture_output=True, text=True, timeout=30).stdout


def test_environment_switches_are_checked_at_the_start(tmp_path, run, monkeypatch):
    """A bad BEAMTRT_NATIVE or BEAMTRT_KERNELS was refused at the first forward, after the models loaded, and
    BEAMTRT_KERNELS not at all where no drafter ran (--no-spec); now before anything else, as a bad flag is."""
    missing = str(tmp_path / "missing.jsonl")  # what the commands would refuse next, before loading anything
    for name, value, needle in (("BEAMTRT_NATIVE", "2", "expected 0 (PyTorch) or 1"),
                                ("BEAMTRT_KERNELS", "bogus", "expected auto, host or off")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            assert_one_line_error(run("runtime/run.py", "--no-spec", "--prompts", missing), f"{name}={value}: ", needle)
            assert_one_line_error(run("scripts/bench_decode.py", "--batches", "0"), f"{name}={value}: ", needle)


def test_run_bad_values_are_one_line(tmp_path, run):
    assert_one_line_error(run("runtime/run.py", "--max-new-tokens", "0"), "--max-new-tokens")
    assert_one_line_error(run("runtime/run.py", "--temperature", "-1"), "temperature")
    assert_one_line_error(run("runtime/run.py", "--top-p", "1.5"), "top_p")
    assert_one_line_error(run("runtime/run.py", "--temperature", "0.7", "--top-p", "1e-300"),  # 0 as a float32: it
                          "top_p=1e-300 (in (0, 1], at least 1e-45)")  # sampled the last token id every time
    assert_one_line_error(run("runtime/run.py", "--top-k", "50"), "give them with a --temperature > 0")  # not greedy
    assert_one_line_error(run("runtime/run.py", "--block-size", "1"), "--block-size")
    assert_one_line_error(run("runtime/run.py", "--no-spec", "--draft-threshold", "0"), "drop --drafter / --draft")
    assert_one_line_error(run("runtime/run.py", "--stop", ""), "--stop")
    (tmp_path / "afile").write_text("")
    assert_one_line_error(run("runtime/run.py", "--json", str(tmp_path / "afile" / "x.json")), "--json",
                          "is a file, not a directory")
    assert_one_line_error(run("runtime/run.py", "--json", str(tmp_path)), "--json", "is a directory")
    os.mkfifo(tmp_path / "pipe")
    assert_one_line_error(run("runtime/run.py", "--json", str(tmp_path / "pipe")), "--json", "not a regular file")
    assert (tmp_path / "pipe").is_fifo()
    assert_one_line_error(run("runtime/run.py", "--temperature", "nan"), "temperature=nan")
    assert_one_line_error(run("runtime/run.py", "--temperature", "inf"), "temperature=inf")
    assert_one_line_error(run("runtime/run.py", "--temperature", "1e-40"), "temperature=1e-40")  # logits / T = inf
    assert_one_line_error(run("runtime/run.py", "--seed", str(2**70)), "--seed must be in [0, 2**63)")
    assert_one_line_error(run("runtime/run.py", "--block-size", "33"), "--block-size", "[2, 32]")
    for flag, value in (("--drafter", "d"), ("--draft-threshold", "0.4")):  # they would be ignored
        assert_one_line_error(run("runtime/run.py", "--no-spec", flag, value), "--no-spec decodes without a drafter")
    # --block-size too, even at its default value: it was ignored (and a missing --prompts file came next)
    assert_one_line_error(run("runtime/run.py", "--no-spec", "--block-size", "8", "--prompts", str(tmp_path / "none")),
                          "--no-spec decodes without a drafter", "--block-size")
    for bad in ("-0.1", "1.5", "nan"):
        assert_one_line_error(run("runtime/run.py", "--draft-threshold", bad), "--draft-threshold", "[0, 1]")
    assert_one_line_error(run("runtime/run.py", "--prompts", str(tmp_path / "missing.jsonl")), "missing.jsonl")
    # '-' is no standard stream here: --json - wrote a file named '-' at the end of the run (here, were it to again)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert_one_line_error(run("runtime/run.py", "--json", "-"), "--json -: give a file path")
        assert_one_line_error(run("runtime/run.py", "--prompts", "-"), "for standard input give /dev/stdin")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"prompt": 3}\n')
    assert_one_line_error(run("runtime/run.py", "--prompts", str(tmp_path / "bad.jsonl")), "bad.jsonl:2")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "hi"\n')
    assert_one_line_error(run("runtime/run.py", "--prompts", str(tmp_path / "broken.jsonl")), "broken.jsonl:1")
    (tmp_path / "deep.jsonl").write_text("[" * 100000 + "\n")
    assert_one_line_error(run("runtime/run.py", "--prompts", str(tmp_path / "deep.jsonl")), "deep.jsonl:1", "nested")
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path / "nope")), "nope", "config.json")
    assert_one_line_error(run("runtime/run.py", "--concurrency", "-1"), "--concurrency")
    assert_one_line_error(run("runtime/run.py", "--engine-dir", str(tmp_path / "none")), "none", "no such directory")
    assert_one_line_error(run("runtime/run.py", "--engine-dir", str(tmp_path)), "not a build", "manifest.json")
    assert_one_line_error(run("runtime/run.py", "--engine-dir", str(tmp_path), "--model", str(tmp_path)),
                          "cannot be combined")
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path)), "not valid JSON")


def test_a_bad_drafter_is_refused_before_the_target_is_loaded(tmp_path, run, monkeypatch):
    """--drafter without a config.json fails at once, not after the target has loaded or been built (beam-mini's
    half minute of conversion on first use)."""
    from beamtrt.build import cli as build_cli
    from beamtrt.models import beam_mini

    def not_now():
        raise AssertionError("beam-mini was made before the drafter was checked")
    monkeypatch.setattr(beam_mini, "ensure_beam_mini", not_now)
    monkeypatch.setattr(build_cli, "LAST_BUILD", tmp_path / "no-last-build")
    no_drafter = f"{tmp_path / 'd'}: no such directory"
    assert_one_line_error(run("runtime/run.py", "--drafter", str(tmp_path / "d"), "--prompt", "hi"), no_drafter)
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path / "m"), "--drafter", str(tmp_path / "d")),
                          no_drafter)
    (tmp_path / "last-build").write_text(f"{tmp_path / 'bf16-tp4'}\n")  # --drafter alone runs beam-mini's, as the
    monkeypatch.setattr(build_cli, "LAST_BUILD", tmp_path / "last-build")  # README says, not the last build
    assert_one_line_error(run("runtime/run.py", "--drafter", str(tmp_path / "d"), "--prompt", "hi"), no_drafter)
    assert_one_line_error(run("build/build_engines.py", "--precision", "bf16", "--drafter", str(tmp_path / "d"),
                              "--out", str(tmp_path / "out")), no_drafter)
    assert not (tmp_path / "out").exists()


def test_a_moved_last_build_names_its_record(tmp_path, run, monkeypatch):
    """Without --engine-dir, run.py runs the build engines/.last-build records: a moved or deleted one, or a garbled
    record, says where the path came from and what to pass instead."""
    from beamtrt.build import cli as build_cli

    record = tmp_path / ".last-build"
    monkeypatch.setattr(build_cli, "LAST_BUILD", record)
    for recorded, shown in ((f"{tmp_path / 'bf16-tp2'}\n", "bf16-tp2"), ("garbage\n", "garbage"), ("\n", "(nothing)"),
                            ("0" * 300, "(not a path)"), ('{\n  "x": 1\n}\n', "(not a path)")):  # a name too long
        record.write_text(recorded)
        assert_one_line_error(run("runtime/run.py", "--prompt", "Hi"), f"{shown}: no such directory", str(record),
                              "--engine-dir DIR", "--model DIR", "build/build_engines.py")
    record.write_text(f"{tmp_path}\n")  # a directory, but no build's
    assert_one_line_error(run("runtime/run.py", "--prompt", "Hi"), f"{tmp_path}: no manifest.json there", str(record))


def test_a_checkpoint_path_that_is_missing_or_a_file_says_so(tmp_path, run, monkeypatch, capsys):
    """A checkpoint or build directory that does not exist, or is a file, says which (it used to be
    'DIR/config.json: missing config.json', 'FILE/config.json/config.json: ...', or 'no such directory' for a file)."""
    from beamtrt.build import cli as build_cli
    from beamtrt.checkpoint import validate

    monkeypatch.setattr(build_cli, "LAST_BUILD", tmp_path / "no-last-build")
    afile = tmp_path / "config.json"
    afile.write_text("{}")
    missing = f"{tmp_path / 'beam-mni'}: no such directory"
    is_file = f"{afile}: is a file; expected a "
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path / "beam-mni")), missing)
    assert_one_line_error(run("runtime/run.py", "--model", str(afile)), is_file)
    assert_one_line_error(run("runtime/run.py", "--drafter", str(afile), "--prompt", "hi"), is_file)
    assert_one_line_error(run("scripts/draft_vocab.py", str(afile), "--data", str(tmp_path)), is_file)
    assert_one_line_error(run("scripts/draft_vocab.py", str(afile), "--data", str(afile)), f"--data {afile}: is a file")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(afile)), f"--data {afile}: is a file")
    for path, needle in ((afile, is_file), (tmp_path / "beam-mni", missing)):
        assert validate.main([str(path)]) == 2
        assert_one_line_error(Result(2, "", capsys.readouterr().err), needle, "build/build_engines.py output")


@pytest.mark.parametrize("script, args", [("runtime/run.py", []), ("scripts/train_drafter.py", []),
                                          ("scripts/eval_drafter.py", ["--data", "."])])
def test_bad_devices_are_one_line(script, args, run):
    """Checked before any model is loaded or made: a name torch does not know, a device type the project does not
    run on, a GPU this host does not have."""
    assert_one_line_error(run(script, *args, "--device", "gpu0"), "--device gpu0", "not a torch device")
    assert_one_line_error(run(script, *args, "--device", "meta"), "--device meta", "only cpu and cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert_one_line_error(run(script, *args, "--device", f"cuda:{count}"), f"--device cuda:{count}")


@pytest.mark.parametrize("script, args", [
    ("runtime/run.py", []), ("scripts/benchmark.py", []), ("scripts/train_drafter.py", []),
    ("scripts/eval_drafter.py", ["--data", "."]), ("scripts/bench_decode.py", []), ("scripts/bench_spec.py", [])])
def test_negative_threads_are_one_line(script, args, run):
    assert_one_line_error(run(script, *args, "--threads", "-2"), "--threads must be in [0, ")
    assert_one_line_error(run(script, *args, "--threads", "100000"), "--threads must be in [0, ")


PATH_FLAGS = {  # every flag naming a file or folder, and each positional path
    "runtime/run.py": ["--engine-dir", "--model", "--drafter", "--prompts", "--json", "--stop"],
    "build/build_engines.py": ["--model", "--drafter", "--calib-prompts", "--out", "--tensorrt-root"],
    "scripts/make_beam_mini.py": ["--out"], "scripts/make_random_beam.py": ["--out"],
    "scripts/bench_decode.py": ["--model", "--json"], "scripts/bench_spec.py": ["--model", "--drafter", "--json"],
    "scripts/bench_tp.py": ["--model", "--drafter", "--work", "--json"],
    "scripts/bench_convert.py": ["--work", "--json"], "scripts/bench_kernels.py": ["--json"],
    "scripts/benchmark.py": ["--model", "--drafter", "--engine-dir", "--prompts", "--out"],
    "scripts/train_drafter.py": ["--target", "--data", "--work", "--out", "--init", "--extra-data",
                                 "--skip-answered-in"],
    "scripts/eval_drafter.py": ["--data", "--drafter", "--target", "--json"],
    "scripts/draft_vocab.py": ["", "--data", "--target"], "scripts/export_triton.py": ["--engine-dir", "--out"],
}


@pytest.mark.parametrize("script", sorted(PATH_FLAGS))
def test_an_empty_value_is_refused_not_read_as_the_default_or_the_working_directory(script, run):
    """`--model "$MODEL"` with MODEL unset: run.py used to run beam-mini instead, build_engines.py to look for
    ./config.json. Every flag but run.py's --prompt (an empty message is a message) refuses an empty value."""
    for flag in PATH_FLAGS[script]:
        proc = run(script, f"{flag}=" if flag else "")
        assert_one_line_error(proc, f"argument {flag or 'drafter'}: an empty value (an unset shell variable?)")
    if script == "runtime/run.py":  # passes the parser, to fail on the flag given with it
        assert_one_line_error(run(script, "--prompt", "", "--max-new-tokens", "0"), "--max-new-tokens")


def test_outputs_that_cannot_be_written_fail_before_the_work(tmp_path, run):
    """An output under a file, or a directory where a file goes, is refused before any model is loaded or made (it
    used to surface as a traceback after the whole decode, benchmark or training)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    under = str(afile / "x")
    for script, args in (("scripts/benchmark.py", ["--out", under]),
                         ("build/build_engines.py", ["--precision", "bf16", "--out", under]),
                         ("scripts/make_beam_mini.py", ["--out", under]),
                         ("scripts/train_drafter.py", ["--target", str(tmp_path), "--out", under]),
                         ("scripts/eval_drafter.py", ["--data", str(tmp_path), "--json", under]),
                         ("scripts/bench_decode.py", ["--model", str(tmp_path), "--json", under]),
                         ("scripts/bench_spec.py", ["--json", under]), ("scripts/bench_tp.py", ["--json", under]),
                         ("scripts/bench_convert.py", ["--work", str(tmp_path / "w"), "--json", under]),
                         ("scripts/bench_kernels.py", ["--json", under])):
        (tmp_path / "config.json").write_text("{}")
        assert_one_line_error(run(script, *args), "afile is a file, not a directory")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path), "--json", str(tmp_path)),
                          "--json", "is a directory")
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", under), "afile is a file, not a directory")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_that_cannot_be_made_names_the_given_path(tmp_path, run, monkeypatch, capsys):
    """Not the temporary name written first: --out /proc/x (writable to root by access(2), but nothing can be made
    there) named /proc/.x.tmp-XXXX; a --json file on a full disk gave 'No space left on device' and no path."""
    import errno

    import beamtrt.models.beam_mini
    from beamtrt.checkpoint.hf import write_json
    from beamtrt.cli_util import run_cli

    def too_late():  # CI has no beam-mini yet: the check comes first, before minutes of conversion (it came after)
        raise AssertionError("--out was checked after beam-mini was made")
    monkeypatch.setattr(beamtrt.models.beam_mini, "ensure_beam_mini", too_late)
    assert_one_line_error(run("build/build_engines.py", "--precision", "bf16", "--out", "/proc/x"),
                          "/proc/x: cannot write in /proc")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    out = tmp_path / "out.json"
    assert run_cli(lambda: write_json(out, {"x": 1})) == 2
    assert capsys.readouterr().err == f"error: {out}: No space left on device\n"
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone


def test_json_outputs_make_their_folders(tmp_path):
    """Every --json (and summary) file goes through checkpoint.hf's write_json, which makes missing folders as
    output_path promises (bench_kernels and `python -m beamtrt.bench.backends` wrote into an existing folder only)."""
    import json

    from beamtrt.checkpoint.hf import write_json

    path = tmp_path / "a" / "b" / "r.json"
    write_json(path, {"x": [1, 2]})
    assert path.read_text() == json.dumps({"x": [1, 2]}, indent=2) + "\n"


def test_an_os_error_is_one_line(capsys):
    from beamtrt.cli_util import run_cli

    def body():
        raise FileExistsError(17, "File exists", "/some/where")
    assert run_cli(body) == 2
    assert capsys.readouterr().err == "error: /some/where: File exists\n"


def test_sigterm_unwinds_like_ctrl_c(capsys):
    """SIGTERM (and SIGHUP) raise where Ctrl-C would: the command's clean-up runs, the exit code is 128 + 15, and
    the caller's handler is back afterwards."""
    import signal
    import time

    from beamtrt.cli_util import run_cli

    cleaned = []

    def body():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        finally:
            cleaned.append(True)
    before = signal.getsignal(signal.SIGTERM)
    assert run_cli(body) == 128 + signal.SIGTERM and cleaned == [True]
    assert capsys.readouterr().err == "terminated\n"
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_mid_write_leaves_nothing(tmp_path):
    """A real process killed with SIGTERM while its temporary output directory exists: nothing is left behind."""
    import signal
    import time

    out = tmp_path / "rb"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts/make_random_beam.py"), "--out", str(out),
                             "--hidden-size", "1024", "--layers", "16", "--experts", "32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not any(".tmp-" in p.name for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "no temporary directory appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and err.strip().endswith("terminated")
    assert list(tmp_path.iterdir()) == []


def test_random_beam_bad_values_are_one_line(tmp_path, run, monkeypatch):
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--top-k", "9"),
                          "num_experts_per_tok=9")
    # these two wrote num_experts 0 with num_experts_per_tok 2, and mlp_only_layers [0, 0]
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--experts", "0",
                              "--top-k", "2"), "--top-k 2 with --experts 0: a model without experts takes --top-k 0")
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--dense-layers", "1", "0",
                              "1"), "--dense-layers 1 0 1: names a layer more than once")
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--heads", "7"),
                          "num_key_value_heads=4")
    for flag, value in (("--max-shard-gb", "nan"), ("--max-shard-gb", "0"), ("--max-shard-gb", "1e300"),  # overflowed
                        ("--seed", str(2**70))):
        assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), flag, value), flag)
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--vocab-size",
                              "100000000000"), "GB checkpoint", "GB free")  # measured, not listed
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--layers", "100000000"),
                          "num_hidden_layers=100000000", "beyond any real model")  # nor its layers listed
    assert not (tmp_path / "x").exists()
    disk = tmp_path / "disk"  # a small disk that a link at --out points into: its free space counts, not the link's
    disk.mkdir()
    (tmp_path / "to-disk").symlink_to(disk / "rb")
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=1000 if Path(path) == disk else
                                                                                usage(path).free))
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "to-disk")),
                          f"GB checkpoint; {disk} has 1e-06 GB free")  # it measured the link's folder, and wrote
    assert not (disk / "rb").exists()
    monkeypatch.undo()
    link = tmp_path / "link"  # dangling: its target is made, as for every output (it failed after the writing)
    link.symlink_to(tmp_path / "made")
    result = run("scripts/make_random_beam.py", "--out", str(link), "--layers", "1", "--hidden-size", "64",
                 "--experts", "0")  # its --top-k is 0 then
    assert result.returncode == 0 and link.is_symlink() and (tmp_path / "made" / "config.json").is_file(), result
    assert BeamConfig.from_file(tmp_path / "made").num_experts_per_tok == 0


def test_random_beam_size_is_measured_on_the_layers_it_has(tmp_path, run, monkeypatch):
    """The free-space check measures one layer of each kind the model has: a 1-layer model of over 500,000 experts
    was refused as a damaged config (its 2-layer probe had over 1,000,000 in all), and one of MoE layers alone with
    --intermediate-size 0 for lacking the dense width it has no use for."""
    monkeypatch.setattr("beamtrt.cli_util.free_bytes", lambda path: 10**9)  # a disk with 1 GB free
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--layers", "1",
                              "--dense-layers", "--experts", "500001"),
                          "--out with these sizes is a 98.56 GB checkpoint; ", "has 1 GB free")
    monkeypatch.undo()
    result = run("scripts/make_random_beam.py", "--out", str(tmp_path / "m"), "--layers", "2", "--dense-layers",
                 "--intermediate-size", "0")
    assert result.returncode == 0 and BeamConfig.from_file(tmp_path / "m").intermediate_size == 0, result


def test_random_beam_refuses_a_tensor_beyond_the_free_memory(tmp_path, run, monkeypatch):
    """Its largest tensor, made in float32 beside the shard being gathered, is checked against the memory the host has
    available before any is made: a giant --vocab-size or --hidden-size had the out-of-memory killer end it."""
    from beamtrt.models import beam

    free = []
    monkeypatch.setattr(beam, "free_memory", lambda device: free.append(device) or 10**7)  # 10 MB available
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--vocab-size", "100000",
                              "--hidden-size", "512"), "the largest tensor (--vocab-size 100,000 × --hidden-size 512) "
                          "needs ", " of memory to be made and written (in float32, then bfloat16, beside the shard "
                          "being gathered: up to --max-shard-gb 2, or one larger tensor alone); this host has 10.0 MB "
                          "available")
    assert free == [torch.device("cpu")] and not (tmp_path / "x").exists()
    from beamtrt.models.random_beam_cli import largest_tensor

    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 16, "moe_intermediate_size": 8, "num_experts": 4,
            "num_experts_per_tok": 2}
    for sizes in ({}, {"vocab_size": 8}, {"num_attention_heads": 16, "head_dim": 64}, {"intermediate_size": 300},
                  {"moe_intermediate_size": 200}, {"num_experts": 500}, {"shared_expert_intermediate_size": 400},
                  {"intermediate_size": 300, "mlp_only_layers": ()}, {"num_experts": 0, "num_experts_per_tok": 0},
                  {"moe_intermediate_size": 200, "mlp_only_layers": (0, 1)}):  # the width of a kind of layer it has
        cfg = BeamConfig(**{"mlp_only_layers": (0,), **base, **sizes})
        assert largest_tensor(cfg)[1] == max(math.prod(s) for s, _, _ in beam.hf_tensor_specs(cfg).values()), sizes


def test_random_beam_refuses_shards_too_small_for_its_size(tmp_path, run):
    """A --max-shard-gb under 1/500 of the checkpoint is one line giving the size that keeps it to 1,000 shard files at
    most (a tiny one wrote a file per tensor: 1,421 files for 8 layers of 64 experts), and that size is taken."""
    sizes = ("--layers", "8", "--experts", "64")
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), *sizes, "--max-shard-gb",
                              "1e-9"), "--max-shard-gb 1e-09 is under 1/500 of this 0.0933 GB checkpoint, the size "
                          "that keeps it to 1,000 shard files at most (a tensor larger than a shard is a file of its "
                          "own): give at least 0.00018")
    assert not (tmp_path / "x").exists()
    assert run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), *sizes, "--max-shard-gb",
               "0.00018").returncode == 0
    assert 100 < len(list((tmp_path / "x").glob("model-*.safetensors"))) <= 1000


def test_random_beam_takes_its_default_shard_size_whatever_the_size(tmp_path, run, monkeypatch):
    """The floor above stops at the default --max-shard-gb: a checkpoint past 1 TB (a fp32 Beam of 501B is 2 TB) was
    refused with the default, asking for a larger one."""
    from beamtrt.models import beam, random_beam_cli

    monkeypatch.setattr(beam, "checkpoint_bytes", lambda cfg, item: 2 * 10**12)
    monkeypatch.setattr(random_beam_cli, "check_room", lambda *a: None)  # as on a host with 2 TB free
    monkeypatch.setattr(random_beam_cli, "write_random_beam", lambda *a, **k: pytest.fail("written"))
    monkeypatch.setattr(random_beam_cli, "memory_bytes", lambda *a: 0)
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--max-shard-gb", "1.9"),
                          "--max-shard-gb 1.9 is under 1/500 of this 2000 GB checkpoint", "give at least 2")
    with pytest.raises(pytest.fail.Exception, match="written"):  # past every check, with the default
        run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"))


def test_prompts_lines_split_on_newlines_only_and_a_model_needs_its_tokenizer(tmp_path, run):
    """A JSON string may hold U+2028 (str.splitlines would cut the line there); a checkpoint without tokenizer files
    is one line, not a TypeError from transformers."""
    from beamtrt.prompts import read_chat_lines

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a\u2028b\u0085c"}, ensure_ascii=False) + "\n",
                                      encoding="utf-8")
    assert read_chat_lines(tmp_path / "p.jsonl") == [(1, [{"role": "user", "content": "a\u2028b\u0085c"}])]
    assert run("scripts/make_random_beam.py", "--out", str(tmp_path / "m"), "--layers", "2").returncode == 0
    (tmp_path / "m" / "generation_config.json").write_text("{}")  # not a tokenizer (a build copied it as one)
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path / "m"), "--no-spec", "--prompt", "hi"),
                          f"{tmp_path / 'm'}: no tokenizer files (none of tokenizer.json, ",
                          "copy the model's tokenizer files into it")  # a --model folder is not rebuilt
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")  # transformers' error lists every model type
    proc = run("runtime/run.py", "--model", str(tmp_path / "m"), "--no-spec", "--prompt", "hi")
    assert_one_line_error(proc, f"{tmp_path / 'm'}: cannot load the tokenizer (")
    assert len(proc.stderr) < 500


def test_prompt_files_say_what_is_wrong_with_them(tmp_path, run):
    """A missing file, a non-UTF-8 file (the line and byte named), a JSON array or plain text (JSON Lines is one
    object per line) and text that is not UTF-8 (on the command line or a lone surrogate escape) are one line each;
    a UTF-8 BOM is read past."""
    from beamtrt.prompts import read_chat_lines

    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\n')
    assert read_chat_lines(tmp_path / "bom.jsonl") == [(1, [{"role": "user", "content": "hi"}])]
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n')
    (tmp_path / "array.json").write_text('[{"prompt": "hi"}]\n')
    (tmp_path / "plain.txt").write_text("hello there\n")
    (tmp_path / "surrogate.jsonl").write_text('{"prompt": "a\\ud800"}\n')
    (tmp_path / "both.jsonl").write_text('{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}\n')
    (tmp_path / "bigint.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "id": ' + "1" * 5000 + "}\n")
    (tmp_path / "typo.jsonl").write_text('{"messages": [{"role": "usr", "content": "hi"}]}\n')  # was rendered as is
    (tmp_path / "official.jsonl").write_text('{"task_id": "T/0", "prompt": "def f():", "test": "assert f()"}\n')
    assert read_chat_lines(tmp_path / "official.jsonl") == [(1, [{"role": "user", "content": "def f():"}])]
    (tmp_path / "export.jsonl").write_text(  # a chat dataset's export (ultrachat): the prompt and the whole chat
        '{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    assert read_chat_lines(tmp_path / "export.jsonl") == [(1, [{"role": "user", "content": "hi"}])]
    for name, needles in (("missing.jsonl", ["(no such file)"]),
                          ("latin1.jsonl", [":2: not UTF-8 text (byte offset 32)", "must be UTF-8"]),
                          ("array.json", [":1: expected", "JSON Lines: one object per line"]),
                          ("plain.txt", [":1: not valid JSON", "JSON Lines: one object per line"]),
                          ("surrogate.jsonl", [":1: not valid UTF-8 text"]),
                          ("both.jsonl", [':1: holds both "prompt" and "messages"',
                                          "the messages do not open with that prompt; give one"]),
                          ("bigint.jsonl", [":2: Exceeds the limit (4300 digits) for integer string conversion"]),
                          ("typo.jsonl", [":1: role 'usr' is not one of system, user, assistant, tool"])):
        assert_one_line_error(run("runtime/run.py", "--prompts", str(tmp_path / name)), f"{name}", *needles)
    assert_one_line_error(run("runtime/run.py", "--prompt", "caf\udce9"), "--prompt: not valid UTF-8 text")
    assert_one_line_error(run("runtime/run.py", "--stop", "caf\udce9"), "--stop: not valid UTF-8 text")  # it was
    # accepted, and never matched


def test_sizes_beyond_the_host_are_one_line(tmp_path, run, capsys, monkeypatch):
    """A size a host cannot hold is one line: the model's context (bench_decode, read from config.json before the
    model is loaded: it came after the load), or an allocation that fails."""
    from beamtrt.bench import decode
    from beamtrt.cli_util import run_cli

    assert run("scripts/make_random_beam.py", "--out", str(tmp_path / "m"), "--layers", "2").returncode == 0
    monkeypatch.setattr(decode, "load_beam", lambda *a, **k: pytest.fail("loaded"))
    assert_one_line_error(run("scripts/bench_decode.py", "--model", str(tmp_path / "m"), "--context", "10000000",
                              "--paths", "torch"), "exceed the model's context")

    def huge() -> None:
        torch.empty(1 << 62, dtype=torch.uint8)

    capsys.readouterr()
    assert run_cli(huge) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory") and len(err.strip().splitlines()) == 1, err


def test_make_beam_mini_bad_values_are_one_line(tmp_path, run, beam_mini):
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m"), "--top-k", "5"), "--top-k")
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m"), "--perturbation", "-1"),
                          "--perturbation")
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m"), "--num-experts", "0"),
                          "--num-experts must be in [1, 33,333]")
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m"), "--num-experts", "40000"),
                          "--num-experts must be in [1, 33,333]")  # before the GGUF is read, not after
    for bad in ("nan", "inf"):
        assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m"), "--perturbation", bad),
                              "--perturbation must be a finite number")
    assert not (tmp_path / "m").exists()
    damaged = tmp_path / "damaged"  # this recipe, its last shard cut short: it was reported as beam-mini
    damaged.mkdir()
    for f in beam_mini.iterdir():
        (damaged / f.name).symlink_to(f)
    last = max(damaged.glob("model-*.safetensors"))
    last.unlink()
    with open(beam_mini / last.name, "rb") as f:
        last.write_bytes(f.read(1000))
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(damaged)), f"{last}: not a valid safetensors "
                          "file", "(damaged since beam-mini was built): pass --force to rebuild it")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "thesis.txt").write_text("years of work")  # a directory beam-mini did not write is kept
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m")),
                          "is not a beam-mini directory")
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["thesis.txt"]
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "s"), "--seed", str(2**70)),
                          "--seed must be in [0, 2**63)")  # before the GGUF is read (it failed after, unnamed)
    (tmp_path / "marker-only").mkdir()  # beam-mini's marker alone (its files removed): was reported built
    shutil.copy2(beam_mini / "beam_mini.json", tmp_path / "marker-only")
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "marker-only")),
                          "not its config.json and weights", "--force")


def test_make_beam_mini_checks_the_disk_before_reading_the_gguf(tmp_path, run, monkeypatch):
    """beam-mini's size is known from the recipe and SmolLM2's shape: a disk too small for it is one line before the
    GGUF is read (--num-experts 33333 was refused only after it, some 20 s in)."""
    from beamtrt.models import beam_mini as bm

    monkeypatch.setattr(bm, "load_smollm2", lambda: pytest.fail("the GGUF was read"))
    monkeypatch.setattr("beamtrt.cli_util.free_bytes", lambda path: 10**8)  # a disk with 100 MB free
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m"), "--num-experts", "33333"),
                          "beam-mini with 33333 experts a layer is a 5310 GB checkpoint; ", "has 0.1 GB free")
    assert not (tmp_path / "m").exists()


def test_the_default_beam_mini_is_checked_as_make_beam_mini_checks_it(tmp_path, run, monkeypatch):
    """The folder the commands use without --model, its marker there but a shard cut short since (or its weights
    removed), is one line offering make_beam_mini.py --force: the marker alone was taken for a complete beam-mini."""
    from beamtrt.build import cli as build_cli
    from beamtrt.models import beam_mini as bm
    from beamtrt.models.random_beam import write_random_beam

    folder = write_random_beam(tmp_path / "beam-mini", TINY, max_shard_bytes=50_000)  # a tiny stand-in, sharded
    (folder / bm.MARKER).write_text("{}")
    ensure = bm.ensure_beam_mini
    monkeypatch.setattr(bm, "ensure_beam_mini", lambda: ensure(folder))  # as if it were the default folder
    monkeypatch.setattr(build_cli, "LAST_BUILD", tmp_path / "no-last-build")
    last = max(folder.glob("model-*.safetensors"))
    last.write_bytes(last.read_bytes()[:1000])
    remedy = f"rebuild it with scripts/make_beam_mini.py --out {folder} --force"
    assert_one_line_error(run("runtime/run.py", "--no-spec", "--prompt", "hi"), f"{last}: not a valid safetensors "
                          "file", f"(damaged since beam-mini was built): {remedy}")
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    assert_one_line_error(run("runtime/run.py", "--no-spec", "--prompt", "hi"),
                          f"{folder} holds beam-mini's {bm.MARKER} but not its config.json and weights", remedy)


def test_random_checkpoint_runs_with_its_own_model(tmp_path):
    out = tmp_path / "rb"
    proc = run_script("scripts/make_random_beam.py", "--out", str(out), "--layers", "2", "--max-shard-gb", "0.001")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors.index.json").is_file()
    from beamtrt.models.beam import load_beam

    model = load_beam(out)
    cache = model.new_cache(1, 8)
    import torch

    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]), cache).logits).all()


@pytest.mark.slow
def test_run_generates_coherent_text(beam_mini):
    # "Answer in one sentence." makes the first token decisive (p 0.55 against 0.13): without it "The" and "L" were
    # 0.150 / 0.145 in fp32, and a host with bf16 instructions flipped them in bf16 (an answer without "Paris")
    proc = run_script("runtime/run.py", "--model", str(beam_mini), "--prompt",
                      "What is the capital of France? Answer in one sentence.", "--max-new-tokens", "16",
                      "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr


@pytest.mark.slow
def test_run_streams_nothing_of_a_stop_string(beam_mini, tmp_path):
    """One request's text is streamed as it is committed: the stop string (and what follows it) was shown there,
    although the final text cut it."""
    import json

    proc = run_script("runtime/run.py", "--model", str(beam_mini), "--prompt",
                      "What is the capital of France? Answer in one sentence.", "--max-new-tokens", "16",
                      "--dtype", "bfloat16", "--stop", "Paris", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    request = json.loads((tmp_path / "r.json").read_text())["requests"][0]
    assert request["finish_reason"] == "stop" and request["output_text"]  # the stop string came, after some text
    streamed = proc.stdout.split("\n", 1)[1]  # after the ">>> prompt" line
    assert "Pari" not in streamed and streamed.strip() == request["output_text"].strip(), proc.stdout


@pytest.mark.slow
def test_run_prints_the_text_as_generated(beam_mini, tmp_path):
    """The tokenizer's clean-up of spaces (on by default for SmolLM2) rewrote the answer: `echo "Hello !"` was printed
    as `echo "Hello!"`, and a stream lost characters already shown ("I do n" then "I don't" printed "t")."""
    import json

    from beamtrt.prompts import load_tokenizer

    proc = run_script("runtime/run.py", "--model", str(beam_mini), "--prompt",
                      "Write a shell command that prints 'Hello !'", "--max-new-tokens", "12", "--dtype", "bfloat16",
                      "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    request = json.loads((tmp_path / "r.json").read_text())["requests"][0]
    tokenizer = load_tokenizer(beam_mini)
    generated = tokenizer.decode(request["output_ids"], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert tokenizer.decode(request["output_ids"], skip_special_tokens=True) != generated  # the case this checks
    streamed = proc.stdout.split("\n", 1)[1]
    assert request["output_text"] == generated and streamed.strip() == generated.strip(), proc.stdout


@pytest.mark.slow
def test_generation_config_end_of_sequence_ids_stop_decoding_too(mini_vocab_sources, tmp_path):
    """A chat model may name the token its turns end with only in generation_config.json (Qwen3 adds <|endoftext|>
    there), as Hugging Face's generate reads it: it was ignored, and decoding ran past the answer's end."""
    from beamtrt.errors import CheckpointError
    from beamtrt.runtime.loader import hf_sources, load_hf
    from beamtrt.spec.decoder import Request, SpeculativeDecoder

    model = tmp_path / "target"
    shutil.copytree(mini_vocab_sources / "target", model)
    assert not (model / "generation_config.json").exists()

    def decode() -> list[int]:
        target = load_hf(model, None).target
        request = Request((1, 5, 9), 8, frozenset(target.eos_token_ids))
        return SpeculativeDecoder(target, None).generate([request])[0].output_ids
    plain = decode()
    k = next(k for k in range(1, len(plain)) if plain[k] not in plain[:k])  # the first token past the first, new
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [plain[k], 2]}))
    assert len(plain) == 8 and decode() == plain[:k + 1]
    for eos, needle in [("7", "must be a token id or a list of them, got '7'"), ([True], "got [True]"),
                        ({}, "got {}"), (10**6, "eos_token_id 1000000 is outside the vocabulary [0, 49152)")]:
        (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        with pytest.raises(CheckpointError, match=re.escape(f"{model / 'generation_config.json'}: ") + ".*"
                           + re.escape(needle)):
            hf_sources(model, None, False)  # before any weight loads


def test_run_names_the_prompt_a_message_is_about(beam_mini, tmp_path):
    """A prompt too long for the context was 'request 1' (its index among non-blank lines, from 0), after the 54 KB
    prompt was echoed; it is now FILE:LINE, before any answer. An answer is labelled with what its chat asks (the
    last user message: a chat ending in an assistant turn was labelled with that turn). A stop string holding a
    special token among other text never matched; it is refused."""
    import json

    prompts = tmp_path / "p.jsonl"
    chats = [{"prompt": "Say hi."}, {"messages": [{"role": "user", "content": "Count to three."},
                                                  {"role": "assistant", "content": "One, two,"}]}]
    prompts.write_text("\n" + "\n".join(map(json.dumps, chats)) + "\n")
    proc = run_script("runtime/run.py", "--model", str(beam_mini), "--prompts", str(prompts), "--max-new-tokens", "4",
                      "--dtype", "bfloat16", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    assert ">>> Count to three.\n" in proc.stdout and ">>> One, two," not in proc.stdout
    assert [r["prompt"] for r in json.loads((tmp_path / "r.json").read_text())["requests"]] == [
        "Say hi.", "Count to three."]
    prompts.write_text(prompts.read_text() + json.dumps({"prompt": "hello " * 9000}) + "\n")
    proc = run_script("runtime/run.py", "--model", str(beam_mini), "--prompts", str(prompts), "--max-new-tokens", "4",
                      "--dtype", "bfloat16")
    assert_one_line_error(proc, f"{prompts}:4: its prompt (9031 tokens) and --max-new-tokens 4 need 9041 positions "
                                "(verifying blocks of 8), more than the target's context of 8192 tokens; shorten the "
                                "prompt")
    assert ">>>" not in proc.stdout
    unreadable = tmp_path / "unreadable"  # beam-mini's configs and tokenizer, weights that cannot load: refused first
    unreadable.mkdir()
    for f in beam_mini.iterdir():
        if f.suffix == ".safetensors":
            (unreadable / f.name).write_bytes(b"not safetensors")
        else:
            (unreadable / f.name).symlink_to(f)
    proc = run_script("runtime/run.py", "--model", str(unreadable), "--prompt", "hi", "--max-new-tokens", "9000",
                      "--no-spec")
    assert_one_line_error(proc, "--prompt: its prompt (", "--max-new-tokens 9000 need ", " positions, more than the "
                          "target's context of 8192 tokens")
    (tmp_path / "b\udcff").symlink_to(beam_mini)  # a folder name that is not UTF-8 (b"b\xff"): the tokenizer was blamed
    assert_one_line_error(run_script("runtime/run.py", "--model", str(tmp_path / "b\udcff"), "--prompt", "hi"),
                          "the tokenizer library opens only UTF-8 paths; rename the folder whose name is not UTF-8")
    strict = tmp_path / "strict"  # a template that wants a user turn first, as Mistral's does: the line is named
    strict.mkdir()
    for f in beam_mini.iterdir():
        if f.name != "chat_template.jinja":
            (strict / f.name).symlink_to(f)
    (strict / "chat_template.jinja").write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Roles must "
                                                "alternate') }}{% endif %}{{ messages }}")
    prompts.write_text(json.dumps({"prompt": "Hi."}) + "\n" + json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]}) + "\n")
    assert_one_line_error(run_script("runtime/run.py", "--model", str(strict), "--prompts", str(prompts)),
                          f"{prompts}:2: the chat template rejected it (Roles must alternate)")
    assert_one_line_error(run_script("runtime/run.py", "--model", str(beam_mini), "--prompt", "hi", "--stop",
                                     "Paris.<|im_end|>"), "--stop 'Paris.<|im_end|>' holds the special token "
                          "<|im_end|>, which the decoded text never shows")
    assert_one_line_error(run_script("runtime/run.py", "--model", str(beam_mini), "--prompt", "hi", "--stop",
                                     "\ufffd"), "--stop '\ufffd' holds U+FFFD, which the decoded text shows in place")


@pytest.mark.slow
def test_an_output_that_is_closed_or_whose_reader_goes_does_not_stop_the_command(beam_mini, tmp_path):
    """`run.py --json F | head -1` was 'error: Broken pipe', exit 2, and no F: the decode was lost. A closed stderr
    (`2>&-`, as cron may start a command) was a traceback from the first progress line or `sys.stderr.isatty()`."""
    import json

    cmd = [sys.executable, str(ROOT / "runtime/run.py"), "--model", str(beam_mini), "--prompt", "Tell me a story.",
           "--max-new-tokens", "24", "--dtype", "bfloat16", "--json", str(tmp_path / "r.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline() == ">>> Tell me a story.\n"
    proc.stdout.close()  # the reader goes, as `head -1` does after its line
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0 and "error" not in err, err
    assert len(json.loads((tmp_path / "r.json").read_text())["requests"][0]["output_ids"]) == 24

    def with_stderr_closed(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f"{' '.join(map(shlex.quote, args))} 2>&-"], capture_output=True,
                              text=True, timeout=300, cwd=ROOT, check=False)
    closed = with_stderr_closed(*cmd[:-1], str(tmp_path / "closed.json"))
    assert closed.returncode == 0 and closed.stdout.startswith(">>> Tell me a story.\n"), closed
    assert (tmp_path / "closed.json").is_file()
    made = with_stderr_closed(sys.executable, "scripts/make_random_beam.py", "--layers", "2",
                              "--out", str(tmp_path / "m"))
    assert made.returncode == 0 and (tmp_path / "m" / "config.json").is_file(), made
    closed = subprocess.run(["bash", "-c", f"{' '.join(map(shlex.quote, cmd))} >&-"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, check=False)  # the answers were dropped without a word
    assert closed.returncode == 0 and closed.stderr.startswith("warning: stdout is closed: what this command prints "
                                                               "is dropped"), closed


@pytest.mark.slow
def test_ctrl_c_mid_answer_ends_on_a_line_of_its_own(beam_mini):
    """On a terminal the streamed answer and the closing line share the screen: 'interrupted' was glued to the
    unfinished line of text ('...transform intointerrupted')."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "runtime/run.py"), "--model", str(beam_mini), "--prompt",
                             "Write a long story about a lighthouse keeper.", "--max-new-tokens", "2000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = b""
    while seen.count(b"\n") < 2 or len(seen.rsplit(b"\n", 1)[1]) < 20:  # some text after the ">>> prompt" line
        chunk = proc.stdout.read1(4096)
        assert chunk, seen
        seen += chunk
    proc.send_signal(signal.SIGINT)
    out = (seen + proc.stdout.read()).decode()
    assert proc.wait(timeout=60) == 130 and out.endswith("\ninterrupted\n"), out[-300:]


def test_a_run_without_a_verification_step_reports_no_acceptance_length(beam_mini, tmp_path, run):
    """--max-new-tokens 1 (or EOS first): the prefill's token only, no step to measure τ on (the summary line
    formatted None: a traceback)."""
    import json

    proc = run("runtime/run.py", "--model", str(beam_mini), "--prompt", "hi", "--max-new-tokens", "1",
               "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    assert "tokens in" in proc.stderr and "acceptance length -," in proc.stderr
    plain = run("runtime/run.py", "--model", str(beam_mini), "--prompt", "hi", "--max-new-tokens", "1", "--no-spec",
                "--quiet", "--json", str(tmp_path / "plain.json"))
    assert json.loads((tmp_path / "plain.json").read_text())["settings"]["drafter"] is None  # none drafted
    assert plain.stdout == "" and plain.stderr.startswith("[1 request, ")  # no blank line above it under --quiet
    assert f"{beam_mini}, no drafter" in plain.stderr and "drafter None" not in plain.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["acceptance_length"] is None and report["requests"][0]["steps"] == 0
    assert len(report["requests"][0]["output_ids"]) == 1
    # per request too (it said 0.0, a length no step can have), and the request is counted (the summary said 0)
    assert report["requests"][0]["acceptance_length"] is None
    assert report["summary"]["requests"] == 1 and report["summary"]["requests_with_steps"] == 0


def test_the_json_report_records_how_the_run_was_made(beam_mini, tmp_path, run):
    """A sampled run's --json named neither its seed nor its sampling settings, its stops or its model: it could not
    be reproduced from its report."""
    import json

    from beamtrt.config import BeamConfig
    from beamtrt.models.beam_mini import default_drafter_for

    proc = run("runtime/run.py", "--model", str(beam_mini), "--prompt", "hi", "--max-new-tokens", "1", "--temperature",
               "0.7", "--top-p", "0.9", "--top-k", "40", "--seed", "5", "--stop", "xyz", "--json",
               str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    drafter = default_drafter_for(BeamConfig.from_file(beam_mini / "config.json"))
    assert json.loads((tmp_path / "r.json").read_text())["settings"] == {
        "engine_dir": None, "model": str(beam_mini.absolute()), "drafter": str(drafter.absolute()), "backend": "torch",
        "device": "cpu", "seed": 5,
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "max_new_tokens": 1, "stop": ["xyz"]}


def test_a_model_larger_than_the_free_memory_is_refused_before_loading(beam_mini, tmp_path, run, monkeypatch):
    """On the host, allocating a model beyond its memory succeeds (Linux overcommits) and loading it gets the process
    killed by the out-of-memory killer, without a word: the commands that hold a whole model refuse it first."""
    from beamtrt.models import beam

    assert 0 < beam.free_memory(torch.device("cpu")) < 2**50  # this host's MemAvailable, read for real
    free = []
    monkeypatch.setattr(beam, "free_memory", lambda device: free.append(device) or 300_000_000)  # 300 MB free
    proc = run("runtime/run.py", "--model", str(beam_mini), "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(proc, f"{beam_mini}: its weights take 1.5 GB in float32 and cpu has 300.0 MB free")
    assert_one_line_error(run("scripts/train_drafter.py", "--target", str(beam_mini), "--data", str(tmp_path / "d"),
                              "--work", str(tmp_path / "w"), "--out", str(tmp_path / "o")), "1.5 GB in float32")
    assert free == [torch.device("cpu")] * 2 and not list(tmp_path.iterdir())


def test_caches_larger_than_the_free_memory_are_refused_before_allocating(mini_vocab_sources, tmp_path, run,
                                                                          monkeypatch):
    """The KV cache holds every request served at once (run.py's default: the whole prompts file) at its longest:
    beyond the host's memory, allocating it succeeded and filling it got the process killed without a word."""
    from beamtrt.models import beam

    src, prompts = mini_vocab_sources, tmp_path / "p.jsonl"
    monkeypatch.setattr(beam, "free_memory", lambda device: 50_000_000)  # the weights fit, ~26 MB
    prompts.write_text('{"prompt": "hi"}\n' * 20)
    flags = ["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--prompts", str(prompts)]
    proc = run("runtime/run.py", *flags, "--max-new-tokens", "8000")
    assert_one_line_error(proc, "the KV cache of 20 requests x ")
    assert re.search(r"positions takes 12\d\.\d MB and cpu has 50\.0 MB free: decode fewer requests at once, or "
                     "shorter ones$", proc.stderr.strip()), proc.stderr
    prompts.write_text('{"prompt": "hi"}\n' * 100)  # a short KV cache, but the drafter's ring holds a window each
    assert_one_line_error(run("runtime/run.py", *flags, "--max-new-tokens", "4"),
                          "the drafter's context cache of 100 requests x 4096 positions takes")
    # bench_decode.py allocated its caches (one per path, held at once) unchecked
    assert_one_line_error(run("scripts/bench_decode.py", "--model", str(src / "target"), "--batches", "64",
                              "--context", "1000", "--steps", "4", "--dtypes", "float32"),
                          "the KV caches of ", " path(s) x 64 rows x 1012 positions take")


def test_a_target_without_a_tokenizer_or_a_mismatched_cache_is_one_line(mini_vocab_sources, tmp_path, run, monkeypatch):
    """bench_spec.py and eval_drafter.py on a target without tokenizer files were transformers TypeError tracebacks
    after the models loaded; draft_vocab.py took any --target (read only when a cache records its target), and a
    drafter of a smaller vocabulary than the caches' tokens was told a draft vocabulary's general rule."""
    import json

    from beamtrt.models import beam

    monkeypatch.setattr(beam, "load_beam", lambda *a, **k: pytest.fail("the target was loaded"))
    src, no_tok = mini_vocab_sources, tmp_path / "no-tok"
    no_tok.mkdir()
    for f in (src / "target").iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (no_tok / f.name).symlink_to(f)
    assert_one_line_error(run("scripts/bench_spec.py", "--model", str(no_tok), "--drafter", str(src / "drafter"),
                              "--batches", "1"), f"{no_tok}: no tokenizer files")
    cache = ROOT / "checkpoints" / "beam-mini-dflash2-data-s6"
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(cache), "--target", str(no_tok), "--drafter",
                              str(src / "drafter")), f"{no_tok}: no tokenizer files")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(cache), "--target", str(src / "drafter"),
                              "--drafter", str(src / "drafter")),  # was told to copy tokenizer files into it
                          "is not a Beam-family model")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(cache), "--target", str(no_tok)),
                          "-dflash2: not a checkpoint directory (no config.json) (the default for the target's name: "
                          "pass --drafter DIR)")
    small = tmp_path / "small"
    small.mkdir()
    cfg = json.loads((ROOT / "checkpoints" / "beam-mini-dflash2" / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 1024}))
    assert_one_line_error(run("scripts/draft_vocab.py", str(small), "--data", str(cache)), "--data holds token id ",
                          "beyond the drafter's vocabulary of 1024: the caches are another target's answers")
    assert_one_line_error(run("scripts/draft_vocab.py", str(small), "--data", str(cache), "--target",
                              str(tmp_path / "nosuch")), f"--target {tmp_path / 'nosuch'}: ")
    assert not (small / "draft_vocab.json").exists()


def test_an_output_inside_what_the_command_reads_is_refused(mini_vocab_sources, tmp_path, run, monkeypatch):
    """A --json (benchmark.py's --out) into a checkpoint, a cache or a prompts file the command reads would replace or
    add a file there (it replaced a target's config.json, a cache's meta.json, a model's weights); into a folder whose
    contents a benchmark replaces (--work) it would be deleted. Refused before any model is loaded, the inputs
    intact."""
    from beamtrt.models import beam

    monkeypatch.setattr(beam, "load_beam", lambda *a, **k: pytest.fail("the target was loaded"))
    target, drafter, prompts = (mini_vocab_sources / name for name in ("target", "drafter", "prompts.jsonl"))
    before = {f: f.read_bytes() for f in (target / "config.json", drafter / "config.json", prompts)}
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "meta.json").write_text("{}")
    pair = ["--model", str(target), "--drafter", str(drafter)]
    from beamtrt.build import cli as build_cli

    record = tmp_path / ".last-build"
    record.write_text("/somewhere/nvfp4-tp4\n")
    monkeypatch.setattr(build_cli, "LAST_BUILD", record)
    from beamtrt.runtime.loader import Sources  # an older build's tokenizer is its source checkpoint's: read too

    assert ("the tokenizer", target) in Sources(target, None).inputs(tmp_path / "build")
    for script, args, needle in (
            ("runtime/run.py", [*pair, "--json", str(target / "config.json")],
             f"--json {target / 'config.json'}: is inside the target {target}, which this command reads"),
            ("runtime/run.py", [*pair, "--prompts", str(prompts), "--json", str(prompts)],
             f"--json {prompts}: is --prompts {prompts}, which this command reads"),
            ("runtime/run.py", [*pair, "--json", str(record)],  # engines/.last-build: the next run.py's default
             f"--json {record}: is the last build's record {record}, which this command reads"),
            ("scripts/benchmark.py", [*pair, "--families", "chat", "--prompts", f"chat={prompts}", "--out",
                                      str(drafter / "bench")],
             f"--out {drafter / 'bench'}.json: is inside the drafter"),
            ("scripts/bench_spec.py", [*pair, "--json", str(drafter / "config.json")], "is inside the drafter"),
            ("scripts/bench_decode.py", ["--model", str(target), "--json", str(target / "model.safetensors")],
             "is inside the target"),
            ("scripts/eval_drafter.py", ["--data", str(cache), "--target", str(target), "--drafter", str(drafter),
                                         "--json", str(cache / "meta.json")], f"is inside --data {cache}"),
            ("scripts/bench_tp.py", ["--work", str(tmp_path / "w"), "--json", str(tmp_path / "w" / "r.json")],
             "is inside --work"),
            ("scripts/bench_convert.py", ["--work", str(tmp_path / "w"), "--json", str(tmp_path / "w" / "r.json")],
             "is inside --work")):
        assert_one_line_error(run(script, *args), needle)
    assert {f: f.read_bytes() for f in before} == before and (cache / "meta.json").read_text() == "{}"
    assert record.read_text() == "/somewhere/nvfp4-tp4\n"
    assert not (tmp_path / "w").exists() and not (drafter / "bench.json").exists()
    from beamtrt.bench import tp
    from beamtrt.models import beam_mini

    monkeypatch.setattr(tp, "build", lambda *a, **k: pytest.fail("bench_tp.py built"))
    monkeypatch.setattr(beam_mini, "TRAINED_DRAFTER", drafter)  # bench_tp's builds read beam-mini's by default
    assert_one_line_error(run("scripts/bench_tp.py", "--work", str(tmp_path / "w"), "--json",
                              str(drafter / "config.json")), f"is inside the drafter {drafter}")


def test_bench_spec_refuses_requests_beyond_the_context_before_loading(mini_vocab_sources, run, monkeypatch):
    """bench_spec.py loaded the models (half a minute on beam-mini) before the decoder refused the first request."""
    from beamtrt.runtime import loader

    monkeypatch.setattr(loader, "load_hf", lambda *a, **k: pytest.fail("loaded"))
    src = mini_vocab_sources
    assert_one_line_error(run("scripts/bench_spec.py", "--model", str(src / "target"), "--drafter",
                              str(src / "drafter"), "--max-new-tokens", "100000"),
                          "benchmark prompt 1: its prompt (", "and --max-new-tokens 100000 need", "more than the "
                          "target's context of 32768 tokens")


def test_bench_spec_counts_steps_as_run_py_does(mini_vocab_sources, run, tmp_path):
    """`steps` sums the requests' steps and `decoder_steps` counts the batched ones, as in run.py --json (bench_spec
    had them the other way round, with `request_steps` for the sum)."""
    src, report = mini_vocab_sources, tmp_path / "spec.json"
    assert run("scripts/bench_spec.py", "--model", str(src / "target"), "--drafter", str(src / "drafter"), "--batches",
               "2", "--max-new-tokens", "6", "--block-size", "4", "--json", str(report)).returncode == 0
    point = json.loads(report.read_text())["results"][0]
    for mode in ("spec", "no_spec"):
        r = point[mode]
        assert "request_steps" not in r and r["decoder_steps"] < r["steps"] <= 2 * r["decoder_steps"], r
        # the tokens after each request's first, over the steps' time (the prefill's token is not decode speed)
        assert r["decode_tokens_per_s"] == pytest.approx((r["tokens"] - 2) / (r["step_s"] * r["decoder_steps"]),
                                                         rel=1e-2)  # step_s is rounded
    assert r["steps"] == r["tokens"] - 2  # no drafter: a token a request a step, after the prefill's
    assert point["decode_speedup"] == pytest.approx(  # speculative over plain (an inverted ratio survived)
        point["spec"]["decode_tokens_per_s"] / point["no_spec"]["decode_tokens_per_s"], abs=2e-3)


def test_bench_bad_values_are_one_line(tmp_path, run):
    assert_one_line_error(run("scripts/bench_decode.py", "--model", str(tmp_path), "--batches", "0"), "--batches")
    assert_one_line_error(run("scripts/bench_spec.py", "--model", str(tmp_path), "--batches", "99"), "--batches")
    assert "batch sizes, each in [1, 16]" in " ".join(run("scripts/bench_spec.py", "--help").stdout.split())
    assert "a build already there from other inputs or settings is replaced" in " ".join(
        run("scripts/bench_tp.py", "--help").stdout.split())
    assert_one_line_error(run("scripts/bench_spec.py", "--model", str(tmp_path), "--max-new-tokens", "1"),
                          "--max-new-tokens must be >= 2")
    assert_one_line_error(run("scripts/bench_spec.py", "--model", str(tmp_path), "--block-size", "99"),
                          "--block-size must be in [2, 32]")
    assert_one_line_error(run("scripts/bench_spec.py", "--model", str(tmp_path), "--draft-threshold", "2"),
                          "--draft-threshold", "[0, 1]")
    assert_one_line_error(run("scripts/benchmark.py", "--draft-threshold", "-1"), "--draft-threshold", "[0, 1]")
    for script, flag, values in (("scripts/bench_spec.py", "--batches", ["1", "16", "1"]),  # measured twice (the
                                 ("scripts/bench_decode.py", "--dtypes", ["float32", "float32"]),  # second result
                                 ("scripts/bench_convert.py", "--precisions", ["fp8", "fp8"]),  # replaced the first
                                 ("scripts/bench_tp.py", "--tp", ["1", "1"]),  # in bench_convert's JSON)
                                 ("scripts/benchmark.py", "--families", ["gsm8k", "gsm8k"])):
        assert_one_line_error(run(script, flag, *values), f"argument {flag}: {values[-1]} given twice")
    assert_one_line_error(run("scripts/bench_decode.py", "--model", str(tmp_path / "nope")), "nope")
    assert_one_line_error(run("scripts/bench_kernels.py", "--repeats", "0"), "--repeats must be >= 1")
    assert "timed runs per point; a verification point takes at most 10 of them on the GPU and 3 on the host" in (
        " ".join(run("scripts/bench_kernels.py", "--help").stdout.split()))  # it said "timed runs per point" alone
    from beamtrt.bench import convert

    layers = {convert.source_config(gb).num_hidden_layers: gb for gb in (0.1, 0.8, 1.0, 1.2, 4.3)}
    assert sorted(layers)[:3] == [2, 3, 4]  # every size's drafter is a valid one (3 layers named layer 1 twice)
    assert all(len(set(convert.drafter_config(convert.source_config(gb)).target_layer_ids)) == 2
               for gb in layers.values())
    assert_one_line_error(run("scripts/bench_convert.py", "--work", str(tmp_path), "--size-gb", "0"), "--size-gb")
    assert_one_line_error(run("scripts/bench_convert.py", "--work", str(tmp_path / "w"), "--size-gb", "inf"),
                          "--size-gb must be a finite number")
    assert_one_line_error(run("scripts/bench_convert.py", "--work", str(tmp_path / "w"), "--size-gb", "1e12"),
                          "--size-gb", "GB free")  # more than the disk holds: refused before writing anything
    assert not (tmp_path / "w").exists()
    assert_one_line_error(run("scripts/bench_convert.py", "--work", str(tmp_path / "w"), "--size-gb", "0.01", "--tp",
                              "3"), "--tp 3: TP 3 does not divide the target's 16 attention heads")
    assert not (tmp_path / "w").exists()  # before its sources are generated
    assert_one_line_error(run("scripts/bench_tp.py", "--work", str(tmp_path), "--tp", "0"), "--tp")
    assert_one_line_error(run("scripts/bench_tp.py", "--work", str(tmp_path), "--max-new-tokens", "1"),
                          "--max-new-tokens must be >= 2")  # its speedup was the prefill's tokens/s
    from beamtrt.models.random_beam import write_random_beam  # refused from its config before any build: they were

    model = write_random_beam(tmp_path / "m", TINY, dtype=torch.float32)  # refused after the earlier --tp's runs
    for args, needle in ((["--tp", "1", "3"], "--tp 3: TP 3 does not divide the target's"),
                         (["--max-new-tokens", "100000000"], ("--max-new-tokens 100000000 is more than the target's "
                                                              f"context of {TINY.max_position_embeddings} tokens")),
                         (["--model", str(tmp_path / "nosuch")], f"{tmp_path / 'nosuch'}")):
        model_args = [] if "--model" in args else ["--model", str(model)]
        assert_one_line_error(run("scripts/bench_tp.py", "--work", str(tmp_path / "w"), *model_args, *args), needle)
    assert not (tmp_path / "w").exists()
    if not torch.cuda.is_available():
        assert_one_line_error(run("scripts/bench_kernels.py"), "no CUDA device here")


def test_bench_decode_measures_a_tiny_model(tmp_path, run):
    """bench_decode.py to its end: its --json (also what it prints) records the settings and a positive rate per
    point."""
    from beamtrt.models.random_beam import write_random_beam

    model, out = write_random_beam(tmp_path / "m", TINY, dtype=torch.float32), tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:  # one thread: OpenMP's spin-waits make tiny steps slow on a busy 2-core host
        proc = run("scripts/bench_decode.py", "--model", str(model), "--dtypes", "float32", "--batches", "1", "2",
                   "--context", "4", "--steps", "4", "--paths", "torch", "--threads", "1", "--json", str(out))
    finally:
        torch.set_num_threads(threads)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert json.loads(proc.stdout) == data
    assert (data["model"], data["context"], data["steps"], data["device"], data["threads"]) == (
        str(model), 4, 4, "cpu", 1)
    assert [(r["dtype"], r["batch"], r["path"]) for r in data["results"]] == [("float32", 1, "torch"),
                                                                                ("float32", 2, "torch")]
    for r in data["results"]:
        assert r["tokens_per_s"] > 0 and r["weight_streaming_bound_tokens_per_s"] > 0, r
        assert r["active_weight_mb_per_step"] > 0 and r["gemv_bandwidth_gb_s"]["torch"] > 0, r
        assert ("fraction_of_bound" in r) == (r["batch"] == 1) and r.get("fraction_of_bound", 0) >= 0, r  # 3 places


def test_bench_spec_profiles_a_small_model(mini_vocab_sources, tmp_path, run):
    """bench_spec.py to its end: its --json (also what it prints) records the settings and, per batch, both decoders'
    token counts (equal), rates and acceptance length."""
    src, out = mini_vocab_sources, tmp_path / "r.json"
    threads = torch.get_num_threads()
    try:  # one thread: OpenMP's spin-waits make tiny steps slow on a busy 2-core host
        proc = run("scripts/bench_spec.py", "--model", str(src / "target"), "--drafter", str(src / "drafter"),
                   "--batches", "1", "2", "--block-size", "4", "--max-new-tokens", "6", "--threads", "1", "--json",
                   str(out))
    finally:
        torch.set_num_threads(threads)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert json.loads(proc.stdout) == data
    assert (data["model"], data["drafter"], data["threads"]) == (str(src / "target"), str(src / "drafter"), 1)
    assert (data["block_size"], data["max_new_tokens"], data["dtype"], data["draft_threshold"]) == (4, 6, "float32", 0)
    assert [r["batch"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        spec, plain = r["spec"], r["no_spec"]
        assert r["batch"] <= spec["tokens"] == plain["tokens"] <= 6 * r["batch"], r
        assert spec["tokens_per_s"] > 0 and plain["tokens_per_s"] > 0 and spec["steps"] > 0, r
        assert spec["acceptance_length"] >= 1 and spec["steps"] <= plain["steps"], r


def test_bench_convert_measures_a_build(tmp_path, run, monkeypatch):
    """bench_convert.py to its end: its --json records the sources' size and, per precision, the build's time, stages,
    rates and peak memory; the builds are removed and the sources kept. Sources of the tiny config, not of
    --size-gb's smallest (0.36 GB, a quarter of a minute here): the build child process and the report are the
    same."""
    from beamtrt.bench import convert
    from beamtrt.cli_util import WORK_MARK

    monkeypatch.setattr(convert, "source_config", lambda size_gb: TINY)
    work, out = tmp_path / "w", tmp_path / "r.json"
    proc = run("scripts/bench_convert.py", "--work", str(work), "--size-gb", "0.01", "--precisions", "bf16",
               "--tp", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    weights = sum(f.stat().st_size for f in (work / "target").glob("*.safetensors"))
    assert (data["source_bytes"], data["tp"], list(data["precisions"])) == (weights, 1, ["bf16"]) and weights > 0
    r = data["precisions"]["bf16"]
    assert r["seconds"] > r["stage_seconds"]["target"] > 0 and r["peak_rss_mb"] > 0, r
    assert (r["convert_mb_per_s"], r["end_to_end_mb_per_s"]) == (
        round(weights / 1e6 / r["stage_seconds"]["target"], 1), round(weights / 1e6 / r["seconds"], 1)), r
    assert f"bf16: convert {r['convert_mb_per_s']} MB/s" in proc.stdout
    assert sorted(p.name for p in work.iterdir()) == sorted([WORK_MARK, "drafter", "target"])  # no build left


def test_bench_tp_passes_its_commands_the_paths_the_user_gave(tmp_path, run, monkeypatch):
    """bench_tp.py's builds and runs start in the repository: a relative --model, --drafter or --work was read from
    there (a build went into <repo>/<work>, outside the folder the user named)."""
    from beamtrt.bench import tp
    from beamtrt.errors import BeamtrtError

    built = []

    def build(precision, ranks, work, model, drafter):
        built.append((work, model, drafter))
        raise BeamtrtError("stop here")
    monkeypatch.setattr(tp, "build", build)
    monkeypatch.chdir(tmp_path)
    from beamtrt.models.random_beam import write_random_beam  # its config is read first

    write_random_beam(tmp_path / "m", TINY, dtype=torch.float32)
    assert_one_line_error(run("scripts/bench_tp.py", "--model", "m", "--drafter", "d", "--work", "w", "--tp", "1"),
                          "stop here")
    assert built == [(tmp_path / "w", str(tmp_path / "m"), str(tmp_path / "d"))]


def test_bench_tp_measures_a_build(mini_vocab_sources, tmp_path, run):
    """bench_tp.py to its end (only its errors and paths were tested): one build, its plain and speculative runs
    (run.py in one process at TP 1), and a --json that records the inputs and each run's rate, steps and time split,
    unrounded."""
    src, out = mini_vocab_sources, tmp_path / "tp.json"
    proc = run("scripts/bench_tp.py", "--model", str(src / "target"), "--drafter", str(src / "drafter"), "--tp", "1",
               "--concurrency", "1", "--max-new-tokens", "2", "--work", str(tmp_path / "w"), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert (data["model"], data["drafter"], data["precision"], data["max_new_tokens"]) == (
        str(src / "target"), str(src / "drafter"), "bf16", 2)
    (row,) = data["runs"]
    assert (row["tp"], row["concurrency"]) == (1, 1), row
    rates = row["spec"]["decode_tokens_per_s"], row["plain"]["decode_tokens_per_s"]  # after each first token
    assert row["speedup"] == rates[0] / rates[1] > 0, row  # of unrounded rates
    for side in ("plain", "spec"):
        assert row[side]["decode_tokens_per_s"] > 0 and row[side]["steps"] == row[side]["decoder_steps"] >= 1, row
        assert row[side]["decode_tokens_per_s"] != round(row[side]["decode_tokens_per_s"], 2), row  # as measured
        assert set(row[side]["step_s"]) == {"target", "drafter", "communication", "other"}, row
    assert row["plain"]["acceptance_length"] is None or row["plain"]["acceptance_length"] == 1
    assert row["spec"]["acceptance_length"] >= 1, row


def test_bench_work_folders_of_other_files_are_refused(tmp_path, run):
    """bench_tp / bench_convert delete and replace what they find in --work (a build of other inputs, sources of
    another size): a folder they did not make is refused before anything in it is touched."""
    from beamtrt.cli_util import WORK_MARK, work_dir
    from beamtrt.errors import BeamtrtError

    mine = tmp_path / "models"
    (mine / "target").mkdir(parents=True)
    (mine / "target" / "config.json").write_text('{"num_hidden_layers": 2}')
    assert_one_line_error(run("scripts/bench_convert.py", "--work", str(mine), "--size-gb", "0.01"),
                          f"--work {mine}: holds files that bench_convert.py did not make")
    assert_one_line_error(run("scripts/bench_tp.py", "--work", str(mine)), "bench_tp.py did not make")
    # before the target is read (or beam-mini made, half a minute where it is not yet: this line had 50 in CI)
    assert_one_line_error(run("scripts/bench_tp.py", "--work", str(mine), "--model", str(tmp_path / "absent")),
                          "bench_tp.py did not make")
    assert sorted(p.name for p in mine.rglob("*")) == ["config.json", "target"]

    assert not work_dir(tmp_path / "new" / "w", "bench_tp.py", make=False).exists()  # checked alone: nothing made
    work = work_dir(tmp_path / "new" / "w", "bench_tp.py")  # made, and marked as the benchmark's
    (work / "bf16-tp1").mkdir()
    assert work_dir(work, "bench_tp.py") == work  # its own earlier folder: reused
    with pytest.raises(BeamtrtError, match="bench_convert.py did not make"):
        work_dir(work, "bench_convert.py")
    assert (work / WORK_MARK).read_text() == "bench_tp.py\n"
    with pytest.raises(BeamtrtError, match="is a file"):
        work_dir(work / WORK_MARK, "bench_tp.py")


@pytest.mark.parametrize("sampled", [False, True])
def test_the_verification_point_times_both_places(sampled):
    """bench_kernels' verification row (on the device, and as the loop did it on the host) runs on any device; here
    the CPU, where both places are the same."""
    from beamtrt.bench.kernels import verify_point

    point = verify_point(2, 7, 1000, 4, sampled, 2, device="cpu")
    assert point["kernel"] == "verification" and point["sampled"] is sampled
    assert point["device_ms"] > 0 and point["host_ms"] > 0


def test_a_default_drafter_that_does_not_fit_offers_only_the_commands_own_flags(tmp_path, run):
    """beam-mini's drafter on another target: run.py offers --drafter or --no-spec; bench_spec, which has no
    --no-spec (it runs both), and build_engines.py offer --drafter only."""
    assert run("scripts/make_random_beam.py", "--out", str(tmp_path / "m"), "--layers", "2").returncode == 0
    for proc in (run("scripts/bench_spec.py", "--model", str(tmp_path / "m"), "--batches", "1"),
                 run("build/build_engines.py", "--precision", "bf16", "--model", str(tmp_path / "m"), "--out",
                     str(tmp_path / "out"))):
        assert_one_line_error(proc, "does not fit this target", "--drafter DIR")
        assert "--no-spec" not in proc.stderr
    assert not (tmp_path / "out").exists()
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path / "m"), "--prompt", "hi"),
                          "does not fit this target", "--drafter DIR", "or --no-spec")


def test_build_engines_names_the_checkpoint_a_build_given_as_model_came_from(tmp_path, run):
    """build_engines.py --model on a build (or its target/) names the checkpoint its manifest records as the target's
    source: it named the manifest field to look in, which it still does when the manifest records none or is
    unreadable."""
    build, source = tmp_path / "build", tmp_path / "beam"
    (build / "target").mkdir(parents=True)
    source.mkdir()
    generic = "pass the Hugging Face checkpoint it was built from (its manifest.json's target.source)"
    for manifest, remedy in (({"target": {"source": str(source)}}, (f"pass --model {source}, the Hugging Face "
                                                                    "checkpoint it was built from")),
                             ({"target": {"source": "/nonexistent/beam"}}, generic),  # moved, or relative elsewhere
                             ({"target": {}}, generic)):
        (build / "manifest.json").write_text(json.dumps(manifest))
        for model in (build, build / "target"):
            assert_one_line_error(run("build/build_engines.py", "--precision", "bf16", "--model", str(model), "--out",
                                      str(tmp_path / "again")), f"--model {model}: ", remedy)
    (build / "manifest.json").write_text("{")
    assert_one_line_error(run("build/build_engines.py", "--precision", "bf16", "--model", str(build), "--out",
                              str(tmp_path / "again")), "(its manifest.json's target.source)")


def test_a_build_given_as_model_points_to_engine_dir(mini_vocab_sources, tmp_path, run, monkeypatch):
    """It said '<build>/config.json: missing config.json'. And run on --engine-dir without mpirun (every rank's weights
    in one process), like --model, a build larger than the free memory is refused before loading (a build of Beam
    would be killed by the out-of-memory killer)."""
    from beamtrt.models import beam

    src, out = mini_vocab_sources, tmp_path / "build"
    assert run("build/build_engines.py", "--precision", "bf16", "--model", str(src / "target"), "--drafter",
               str(src / "drafter"), "--out", str(out)).returncode == 0
    chat = ["--families", "chat", "--prompts", f"chat={src / 'prompts.jsonl'}"]  # no benchmark package needed
    for command, extra in (("runtime/run.py", []), ("scripts/benchmark.py", chat)):
        assert_one_line_error(run(command, "--model", str(out), *extra), f"--model {out}: a build_engines.py output, "
                                                                         f"not a Hugging Face checkpoint: pass "
                                                                         f"--engine-dir {out}")
    assert_one_line_error(run("runtime/run.py", "--model", str(out / "target")),  # was an unknown-fields error
                          f"--model {out / 'target'}: a folder of the build_engines.py output {out}, not a Hugging "
                          f"Face checkpoint: pass --engine-dir {out}")
    proc = run("scripts/bench_spec.py", "--model", str(out))  # it has no --engine-dir to offer
    assert_one_line_error(proc, f"--model {out}: a build_engines.py output, not a Hugging Face checkpoint")
    assert "--engine-dir" not in proc.stderr
    for model in (out, out / "target"):  # was '<build>/config.json: missing config.json', an unknown-fields error
        assert_one_line_error(run("build/build_engines.py", "--precision", "bf16", "--model", str(model), "--out",
                                  str(tmp_path / "again")),
                              f"--model {model}: ", f"not a Hugging Face checkpoint: pass --model {src / 'target'}, "
                                                   "the Hugging Face checkpoint it was built from")
    # the build's drafter/ as --drafter: "architectures must name one of DFlashDraftModel, ..., got None"
    assert_one_line_error(run("build/build_engines.py", "--precision", "bf16", "--drafter", str(out / "drafter"),
                              "--out", str(tmp_path / "again")),
                          f"--drafter {out / 'drafter'}: a folder of the build_engines.py output {out}, not a Hugging "
                          f"Face checkpoint: pass --drafter {src / 'drafter'}, the drafter checkpoint it was built "
                          "from")
    assert_one_line_error(run("runtime/run.py", "--model", str(src / "target"), "--drafter", str(out / "drafter")),
                          f"--drafter {out / 'drafter'}: a folder of the build_engines.py output {out}, not a Hugging "
                          "Face checkpoint")
    from beamtrt.runtime.loader import not_a_build

    zoo = tmp_path / "zoo"  # a drafter beside another program's manifest.json is not a build's
    shutil.copytree(src / "drafter", zoo / "d")
    (zoo / "manifest.json").write_text('{"models": ["d"]}')
    not_a_build(zoo / "d", None, "--drafter")
    monkeypatch.setattr(beam, "free_memory", lambda device: 1000)
    assert_one_line_error(run("runtime/run.py", "--engine-dir", str(out), "--prompt", "hi"),
                          "cpu has 0.0 MB free: this command holds the whole model on one device (a build's "
                          "checkpoints run it sharded over mpirun ranks)")


def test_draft_vocab_writes_the_training_tokens(tmp_path, run):
    """From a committed answers cache: the tokens of its sequences but the last 8 greedy ones; the drafter then
    loads with that draft vocabulary."""
    from beamtrt.models.dflash2 import read_draft_vocab
    from beamtrt.train.vocab_cli import training_tokens

    cache = ROOT / "checkpoints" / "beam-mini-dflash2-data-s6"
    drafter = tmp_path / "d"
    shutil.copytree(ROOT / "checkpoints" / "beam-mini-dflash2", drafter,
                    ignore=shutil.ignore_patterns("*.jsonl", "training*.json", "draft_vocab.json"))
    proc = run("scripts/draft_vocab.py", str(drafter), "--data", str(cache), "--eval-sequences", "8")
    assert proc.returncode == 0, proc.stderr
    cfg = DrafterConfig.from_file(drafter / "config.json")
    ids = read_draft_vocab(drafter, cfg)
    assert f"{ids.numel()} of 49152 tokens\n" in proc.stdout and 1000 < ids.numel() < 49152
    assert "warning" not in proc.stderr  # no training.json: nothing to compare --data with
    shutil.copy2(ROOT / "checkpoints" / "beam-mini-dflash2" / "training.json", drafter)  # trained on caches 6-12
    again = run("scripts/draft_vocab.py", str(drafter), "--data", str(cache), "--eval-sequences", "40", "--force")
    assert again.returncode == 0 and f"tokens (replaced one of {ids.numel()} tokens)" in again.stdout
    assert "warning" not in again.stderr, again.stderr  # one of the caches it trained on
    other = ROOT / "checkpoints" / "beam-mini-dflash2-data-s13"  # made later, for runs not kept
    proc = run("scripts/draft_vocab.py", str(drafter), "--data", str(cache), str(other), "--force")
    assert proc.returncode == 0 and f"warning: {drafter} did not train on --data {other} (" in proc.stderr
    every = training_tokens([cache], 0)
    assert set(ids.tolist()) < set(every.tolist())  # held-out answers bring tokens of their own
    mixed = tmp_path / "mixed"  # a feature shard without its answers file counts as its answers would
    mixed.mkdir()
    shutil.copy2(cache / "answers-00000.safetensors", mixed / "features-00000.safetensors")
    shutil.copy2(cache / "answers-00001.safetensors", mixed / "answers-00001.safetensors")
    both = tmp_path / "both"
    both.mkdir()
    for name in ("answers-00000.safetensors", "answers-00001.safetensors"):
        shutil.copy2(cache / name, both / name)
    assert torch.equal(training_tokens([mixed], 0), training_tokens([both], 0))
    assert_one_line_error(run("scripts/draft_vocab.py", str(drafter), "--data", str(tmp_path / "gone")), "gone")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(run("scripts/draft_vocab.py", str(drafter), "--data", str(both), str(tmp_path / "empty"),
                              "--force"),
                          f"--data {tmp_path / 'empty'}: not a feature cache (no answers-*.safetensors")
    assert_one_line_error(run("scripts/draft_vocab.py", str(drafter), "--data", str(both), str(both) + "/"),
                          "--data names the same cache twice")
    assert [p.name for p in drafter.glob("*draft_vocab*")] == ["draft_vocab.json"]  # no temporary file left
    from beamtrt.models.beam import load_beam
    from beamtrt.train.features import target_digest

    assert run("scripts/make_random_beam.py", "--out", str(tmp_path / "t"), "--layers", "2").returncode == 0
    digest = target_digest(load_beam(tmp_path / "t"))

    def made_by(recorded: str) -> Result:  # a cache that records its target: another one's is refused
        (both / "meta.json").write_text(json.dumps({"recipe": {}, "target": recorded}))
        return run("scripts/draft_vocab.py", str(drafter), "--data", str(both), "--target", str(tmp_path / "t"),
                   "--force")
    assert_one_line_error(made_by("0123456789abcdef"), f"{both}: made by another target (digest 0123456789abcdef, "
                                                       f"this one's {digest})")
    assert made_by(digest).returncode == 0
    assert_one_line_error(run("scripts/draft_vocab.py", str(drafter), "--data", str(both), "--target",
                              str(tmp_path / "no-target")), "no-target", "no such directory")
    assert_one_line_error(run("scripts/draft_vocab.py", str(tmp_path), "--data", str(cache)), "config.json")
    assert_one_line_error(run("scripts/draft_vocab.py", str(drafter), "--data", str(cache), "--eval-sequences", "-1"),
                          "--eval-sequences")


def test_draft_vocab_replaces_one_only_with_force(tmp_path, run):
    """A drafter's draft_vocab.json was overwritten without a word but "(replaced one of N tokens)"; it is now one
    line before any work unless --force says so, and left as it was."""
    drafter = tmp_path / "d"
    drafter.mkdir()
    for name in ("config.json", "draft_vocab.json"):
        shutil.copy2(ROOT / "checkpoints" / "beam-mini-dflash2" / name, drafter / name)
    before = (drafter / "draft_vocab.json").read_bytes()
    assert_one_line_error(run("scripts/draft_vocab.py", str(drafter), "--data",
                              str(ROOT / "checkpoints" / "beam-mini-dflash2-data-s6")),
                          f"{drafter}: holds a draft_vocab.json already; pass --force to replace it")
    assert (drafter / "draft_vocab.json").read_bytes() == before


def test_train_drafter_needs_a_target_with_a_tokenizer(tmp_path, run):
    """A random model (make_random_beam.py) has no tokenizer: phase 1 was a TypeError traceback from transformers."""
    assert run("scripts/make_random_beam.py", "--out", str(tmp_path / "m"), "--layers", "2").returncode == 0
    outputs = [f"--{flag}={tmp_path / flag}" for flag in ("data", "work", "out")]
    assert_one_line_error(run("scripts/train_drafter.py", "--target", str(tmp_path / "m"), *outputs, "--prompts", "4"),
                          f"--target {tmp_path / 'm'}: no tokenizer files")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_eval_drafter_bad_values_are_one_line(tmp_path, run):
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path), "--per-kind", "0"),
                          "--per-kind must be >= 1, got 0")  # it named --block-size too, and no value
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path / "gone")), "gone", "no such directory")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path), "--target", str(tmp_path)),
                          "target", "no config.json")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path), "--block-size", "1"),
                          "--block-size must be in [2, 32]", "got 1")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path), str(tmp_path) + "/"),
                          "--data names the same cache twice")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path), str(tmp_path)),  # as typed
                          f"argument --data: {tmp_path} given twice")


def test_a_flag_of_several_values_given_twice_is_one_line(run, tmp_path):
    """draft_vocab.py's usage showed --data CACHE ... --data LAST_CACHE, and argparse kept the last list alone: it
    wrote the vocabulary of one cache. A flag of several values is given once, on every command."""
    for script, first, flag in (("scripts/draft_vocab.py", ["drafter"], "--data"),
                                ("scripts/eval_drafter.py", [], "--data"),
                                ("scripts/train_drafter.py", [], "--extra-data"),
                                ("scripts/make_random_beam.py", ["--out", str(tmp_path / "x")], "--dense-layers")):
        assert_one_line_error(run(script, *first, flag, "1", flag, "2"),
                              f"argument {flag}: given twice; give all its values after one {flag}")


def test_eval_drafter_refuses_a_block_or_cache_the_drafter_cannot_read(tmp_path, run, beam_mini, monkeypatch):
    """From the configs, before any weight loads (beam-mini's take half a minute)."""
    from beamtrt.models import beam

    monkeypatch.setattr(beam, "load_beam", lambda *a, **k: pytest.fail("the target's weights were loaded"))
    drafter = str(ROOT / "checkpoints" / "beam-mini-dflash2")
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path), "--target", str(beam_mini),
                              "--drafter", drafter, "--block-size", "32"), "--block-size 32", "above the drafter's")
    (tmp_path / "meta.json").write_text('{"recipe": {"prompts": 4, "seed": 0}, "taps": [0]}')
    assert_one_line_error(run("scripts/eval_drafter.py", "--data", str(tmp_path), "--target", str(beam_mini),
                              "--drafter", drafter), "features of target layers [0]")
    assert not list(tmp_path.glob("features-*"))  # nothing written into the cache


def test_eval_drafter_scores_a_cache_of_answers_files_and_writes_nothing_into_it(tmp_path, run, mini_vocab_sources,
                                                                                  monkeypatch):
    """It used to rebuild and write the taps of every sequence of a cache (12 minutes and 932 MB for beam-mini's
    cache 13) to score a few; it computes those of the answers it scores, in memory. Its --json holds the table."""
    pytest.importorskip("reasoning_gym")
    from beamtrt.config import DrafterConfig
    from beamtrt.models.beam import load_beam
    from beamtrt.prompts import load_tokenizer
    from beamtrt.train import features
    from beamtrt.train.features import DataRecipe, build_features, load_features, read_answers, with_taps
    from beamtrt.train.prompts import training_prompts

    src, cache = mini_vocab_sources, tmp_path / "cache"
    target = load_beam(src / "target").requires_grad_(False)
    taps = DrafterConfig.from_file(src / "drafter" / "config.json").target_layer_ids
    recipe = DataRecipe(prompts=12, seed=5, mix="v3", max_new_tokens=6, batch=4, shard_size=4, sampled_every=3)
    build_features(target, load_tokenizer(src / "target"), taps, training_prompts(12, 5, "v3"), cache, recipe,
                   quiet=True)
    captured = load_features(cache)
    computed = with_taps(target, taps, read_answers(cache), quiet=True)
    assert torch.equal(computed.ids, captured.ids) and torch.equal(computed.seq_start, captured.seq_start)
    assert torch.allclose(computed.taps.float(), captured.taps.float(), rtol=1e-2, atol=1e-2)
    for shard in cache.glob("features-*.safetensors"):
        shard.unlink()  # the answers files alone, as committed
    before = sorted(p.name for p in cache.iterdir())
    drafter = tmp_path / "drafter"
    shutil.copytree(src / "drafter", drafter)
    (drafter / "training.json").write_text(json.dumps({"data": {"prompts": 3}, "extra_data": [str(tmp_path / "no")]}))
    report = tmp_path / "eval.json"
    result = run("scripts/eval_drafter.py", "--data", str(cache), "--target", str(src / "target"), "--drafter",
                 str(drafter), "--per-kind", "1", "--block-size", "4", "--json", str(report))
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr
    assert "| all | " in result.stdout and sorted(p.name for p in cache.iterdir()) == before
    data = json.loads(report.read_text())  # what reproduces the table, and the table
    assert (data["target"], data["drafter"], data["data"]) == (str(src / "target"), str(drafter), [str(cache)])
    assert (data["block_size"], data["per_kind"]) == (4, 1) and "all" in data["kinds"]
    kinds = {kind: r for kind, r in data["kinds"].items() if kind != "all"}
    assert kinds and all(r["scored"] == 1 <= r["answers"] for r in kinds.values()), data["kinds"]
    assert data["kinds"]["all"]["scored"] == len(kinds)
    assert data["kinds"]["all"]["answers"] == sum(r["answers"] for r in kinds.values())
    for kind, r in data["kinds"].items():
        assert all(1 <= r[key] <= 4 for key in ("tau", "tau_top1", "eval_tau", "eval_tau_top1")), r
        assert 0 <= r["eval_recall"] <= 1, r
        assert (f"| {kind} | {r['answers']} | {r['scored']} | {r['tau']:.2f} | {r['tau_top1']:.2f} | "
                f"{r['eval_tau']:.2f} |") in result.stdout
    (drafter / "training.json").write_text(json.dumps({"data": {"prompts": 3}, "extra_data": [str(cache)]}))
    result = run("scripts/eval_drafter.py", "--data", str(cache), "--target", str(src / "target"), "--drafter",
                 str(drafter), "--per-kind", "1", "--block-size", "4")  # it scored a cache trained on without a word
    assert result.returncode == 0 and "| all | " in result.stdout, result.stderr
    assert f"warning: {cache}: the drafter trained on this cache (its recipe is one its training.json names)" in (
        result.stderr)
    # of several caches, the answers scored are picked before any taps are computed (it computed those of each cache's
    # last answers of each kind, then kept the last of them all); the scores stay those of the answers picked
    copy, computed, sequence_taps = tmp_path / "copy", [], features.sequence_taps
    shutil.copytree(cache, copy)

    def counted(target, taps, seqs, **kwargs):
        computed.append(len(seqs))
        return sequence_taps(target, taps, seqs, **kwargs)
    monkeypatch.setattr(features, "sequence_taps", counted)
    tables = []
    for caches in ([copy], [cache, copy]):
        assert run("scripts/eval_drafter.py", "--data", *map(str, caches), "--target", str(src / "target"), "--drafter",
                   str(drafter), "--per-kind", "1", "--block-size", "4", "--json", str(report)).returncode == 0
        tables.append(json.loads(report.read_text())["kinds"])
    alone, both = tables
    assert computed == [alone["all"]["scored"]] * 2
    assert both == {kind: r | {"answers": 2 * r["answers"]} for kind, r in alone.items()}
    # the answers scored are the same whatever the order of --data (the last of each kind of the caches joined in
    # that order: their τ differed, 2.23 against 2.55 on caches 12 and 13)
    other = tmp_path / "other"
    build_features(target, load_tokenizer(src / "target"), taps, training_prompts(12, 6, "v3"), other,
                   DataRecipe(prompts=12, seed=6, mix="v3", max_new_tokens=6, batch=4, shard_size=4), quiet=True)
    picked = []
    monkeypatch.setattr(features, "sequence_taps", lambda target, taps, seqs, **k: picked.append(
        sorted(tuple(s.tolist()) for s in seqs)) or sequence_taps(target, taps, seqs, **k))
    for caches in ([cache, other], [other, cache]):
        assert run("scripts/eval_drafter.py", "--data", *map(str, caches), "--target", str(src / "target"), "--drafter",
                   str(drafter), "--per-kind", "1", "--block-size", "4").returncode == 0
    assert picked[0] == picked[1]
    # the decoder drafts from the drafter's draft_vocab.json alone, and so does the eval (it drafted from all 49,152)
    answers = read_answers(cache)
    answered = {t for ids, _, n in map(answers.sequence, range(len(answers))) for t in ids[n:].tolist()}
    scores = {}
    for name, vocab in (("answered", sorted(answered)),
                        ("others", [t for t in range(target.cfg.vocab_size) if t not in answered])):
        (drafter / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab}))
        assert run("scripts/eval_drafter.py", "--data", str(cache), "--target", str(src / "target"), "--drafter",
                   str(drafter), "--per-kind", "1", "--block-size", "4", "--json", str(report)).returncode == 0
        scores[name] = json.loads(report.read_text())["kinds"]["all"]
    assert scores["answered"]["eval_recall"] > 0, scores  # the full head's top 16 held none of their tokens
    assert scores["others"]["eval_tau"] == scores["others"]["eval_tau_top1"] == 1.0, scores
    assert scores["others"]["eval_recall"] == 0, scores


def test_train_drafter_guards_its_inputs_and_output(tmp_path, run, mini_vocab_sources, monkeypatch):
    """A tiny end-to-end run (phase 1, training, the drafter saved, its training.json timing each phase); then each way
    a rerun could damage an input, an output or the training state is refused in one line before any work."""
    import torch

    from beamtrt.models.random_beam import write_random_beam
    from beamtrt.train import features

    target = mini_vocab_sources / "target"
    small = ["--prompts", "6", "--max-new-tokens", "6", "--gen-batch", "3", "--steps", "2", "--seqs-per-step", "2",
             "--anchors", "2", "--block-size", "4", "--eval-block-size", "2", "--eval-every", "2", "--layers", "1",
             "--selector-rank", "4", "--threads", "1", "--quiet", "--prompt-mix", "v1"]
    data, work, out = tmp_path / "data", tmp_path / "work", tmp_path / "out"
    paths = ["--target", str(target), "--data", str(data), "--work", str(work)]
    clock, build_features = [0.0], features.build_features

    def slow_build(*args, **kwargs):  # phase 1 made to look 1,000 s long
        build_features(*args, **kwargs)
        clock[0] += 1000
    with monkeypatch.context() as m:
        m.setattr(time, "perf_counter", lambda perf_counter=time.perf_counter: perf_counter() + clock[0])
        m.setattr(features, "build_features", slow_build)
        proc = run("scripts/train_drafter.py", *paths, "--out", str(out), *small)
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").is_file() and json.loads((data / "meta.json").read_text())["target"]
    summary = json.loads((out / "training.json").read_text())  # training's time left out phase 1's: it counted it
    assert summary["data_seconds_this_run"] >= 1000 > summary["train_seconds_this_run"], summary
    assert json.loads((out / "config.json").read_text())["block_size"] == 4  # the block it trained at (it said 16)
    unscored = "not evaluated: nothing held out, as the data has 5 greedy answers"  # 6 prompts, one sampled
    assert f"warning: training is {unscored}" in proc.stderr  # said before training, and in the last line
    assert f"drafter: {out}  ({unscored}" in proc.stdout and "nan" not in proc.stdout
    assert_one_line_error(run("scripts/train_drafter.py", *paths, "--out", str(out), *small), "--force")
    assert run("scripts/train_drafter.py", *paths, "--out", str(out), "--force", *small).returncode == 0
    kept = out / "cache"  # a --skip-answered-in cache kept in the drafter's folder: --force replaced it with the folder
    shutil.copytree(data, kept)
    assert_one_line_error(run("scripts/train_drafter.py", *paths, "--out", str(out), "--force", *small,
                              "--skip-answered-in", str(kept)), f"--out {out}: overlaps --skip-answered-in {kept}")
    assert (kept / "meta.json").is_file()
    shutil.rmtree(kept)
    for inside in (data, work, target, tmp_path):  # an input, the training state, or a folder holding them
        assert_one_line_error(run("scripts/train_drafter.py", *paths, "--out", str(inside), "--force", *small),
                              "overlaps")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    assert_one_line_error(run("scripts/train_drafter.py", *paths, "--out", str(tmp_path / "notes"), "--force", *small),
                          "does not hold a drafter")
    new = ["--out", str(tmp_path / "new")]
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--layers", "2"),  # before phase 1
                          "another layout")
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--data", str(tmp_path / "data2"),
                              "--lr", "1e-4"), "other training settings (--lr 0.001 (now 0.0001))")
    assert not (tmp_path / "data2").exists()
    # a resume on a new cache: its answers were made (hours, on a real target), then refused as other data
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--data", str(tmp_path / "data3")),
                          f"--data {tmp_path / 'data3'}: has 1 shard(s) not answered yet, but --work {work} holds a "
                          "run to resume")
    assert not (tmp_path / "data3").exists()
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--prompts", "200"),  # 2 more shards:
                          f"{data} holds features made with other settings (--prompts 6 (now 200))")  # not the cause
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--extra-data", str(data)),
                          "same cache twice")
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--skip-answered-in", str(data)),
                          f"--skip-answered-in names --data {data} itself")
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--skip-answered-in",
                              str(tmp_path / "gone")), "--skip-answered-in", "gone", "no such directory")
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--data", str(tmp_path / "data5"),
                              "--skip-answered-in", str(data), "--work", str(data)),  # its state went into the cache
                          f"--work {data}: overlaps --skip-answered-in {data}")
    skipping = ["--data", str(tmp_path / "data4"), "--skip-answered-in", str(data), "--data-only"]
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, *skipping),
                          "every one of the 6 prompts was answered")
    assert not (tmp_path / "data4").exists()
    assert run("scripts/train_drafter.py", *paths, *new, *small, *skipping, "--data-seed", "3").returncode == 0
    extra = tmp_path / "extra"  # a resume on another --extra-data cache: refused before its taps are built (hours)
    shutil.copytree(tmp_path / "data4", extra, ignore=shutil.ignore_patterns("features-*"))
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--extra-data", str(extra)),
                          f"{work / 'train_state.pt'} was trained on other data")
    assert not list(extra.glob("features-*"))
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, *skipping[:2], "--data-seed", "3",
                              "--data-only"), "made leaving out")
    for flag, value, needle in (("--seed", "-1", "--seed"), ("--data-seed", str(2**63), "--data-seed"),
                                ("--block-size", "99", "--block-size"), ("--eval-block-size", "20", "--eval-block"),
                                ("--max-new-tokens", str(10**12), "context")):
        assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, flag, value), needle)
    other = tmp_path / "other-target"  # the same config and tokenizer, other weights
    write_random_beam(other, BeamConfig.from_file(target / "config.json"), seed=2, dtype=torch.float32)
    for f in target.iterdir():
        if not f.name.startswith(("model", "config")):
            shutil.copy2(f, other / f.name)
    assert_one_line_error(run("scripts/train_drafter.py", "--target", str(other), "--data", str(data), "--work",
                              str(tmp_path / "w2"), *new, *small), "made by another target")
    assert not (tmp_path / "new").exists() and not (tmp_path / "w2").exists()
    for flag, folder, needle in (("--work", target, f"--work {target}: overlaps --target {target}"),
                                 ("--work", out, "overlaps --init"), ("--data", tmp_path, f"overlaps --work {work}")):
        assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--init", str(out), flag,
                                  str(folder)), needle)  # --init's and --target's files were written into
    assert_one_line_error(run("scripts/train_drafter.py", *paths, *new, *small, "--data", str(out)),
                          f"--data {out}: holds a checkpoint (config.json)")
    fresh = ["--target", str(target), "--data", str(tmp_path / "data3"), "--work", str(tmp_path / "w3"), *new, *small]
    assert_one_line_error(run("scripts/train_drafter.py", *fresh, "--init", str(target)),  # not a drafter: said
                          f"--init {target / 'config.json'}: architectures must name")  # before phase 1, not after
    assert_one_line_error(run("scripts/train_drafter.py", *fresh, "--init", str(out), "--selector-rank", "8"),
                          f"--init {out}: its layout differs from the one to train (selector_rank)")
    broken = tmp_path / "broken-init"  # a drafter whose weights are cut short: found before phase 1, not after it
    shutil.copytree(out, broken)
    (broken / "model.safetensors").write_bytes((broken / "model.safetensors").read_bytes()[:-100])
    assert_one_line_error(run("scripts/train_drafter.py", *fresh, "--init", str(broken)), str(broken))
    (tmp_path / "empty").mkdir()  # an --extra-data or --skip-answered-in cache with no sequences: likewise
    for flag in ("--extra-data", "--skip-answered-in"):
        assert_one_line_error(run("scripts/train_drafter.py", *fresh, flag, str(tmp_path / "empty")),
                              f"{flag} {tmp_path / 'empty'}: not a feature cache (no answers-*.safetensors")
    for flag in ("--seed", "--data-seed"):  # seed × 1,000,003 + n must stay a seed torch takes
        assert_one_line_error(run("scripts/train_drafter.py", *fresh, flag, str(2**32)),
                              f"{flag} must be in [0, 2**32)")
    truncated = tmp_path / "truncated"  # an --extra-data cache with a damaged file: found before phase 1, not after
    shutil.copytree(data, truncated)
    answers = min(truncated.glob("answers-*.safetensors"))
    answers.write_bytes(answers.read_bytes()[:500])
    assert_one_line_error(run("scripts/train_drafter.py", *fresh, "--extra-data", str(truncated)),
                          f"{answers}: corrupt answers file")
    assert not (tmp_path / "data3").exists()
    grown = ["--init", str(out), "--work", str(tmp_path / "w5"), "--out", str(tmp_path / "o5"), "--block-size", "3"]
    assert run("scripts/train_drafter.py", *paths, *small, *grown).returncode == 0  # trained at 4, then at 3
    assert json.loads((tmp_path / "o5" / "config.json").read_text())["block_size"] == 4
    # --data-only writes neither --work nor --out: an --out holding a drafter (the default one after a first run) and
    # a --work in use are no reason to refuse making a cache
    with written_by_another_process(work):
        assert run("scripts/train_drafter.py", *paths, "--out", str(out), *small, "--data", str(tmp_path / "data6"),
                   "--data-only").returncode == 0
    assert (tmp_path / "data6" / "meta.json").is_file()
    # a complete cache on read-only storage serves as --data (it did as --extra-data); one that lacks a shard is
    # refused before phase 1 answers anything
    read_only, mkdtemp = tmp_path / "ro", tempfile.mkdtemp
    shutil.copytree(data, read_only / "cache")

    def no_writes_in_ro(*args, dir=None, **kwargs):
        if str(dir).startswith(str(read_only)):
            raise OSError(errno.EROFS, "Read-only file system")
        return mkdtemp(*args, dir=dir, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkdtemp", no_writes_in_ro)
        ro = ["--data", str(read_only / "cache"), "--data-only"]
        assert run("scripts/train_drafter.py", *paths, "--out", str(out), *small, *ro).returncode == 0
        for name in ("answers-00000.safetensors", "features-00000.safetensors"):
            (read_only / "cache" / name).unlink()
        assert_one_line_error(run("scripts/train_drafter.py", *paths, "--out", str(out), *small, *ro),
                              f"{read_only / 'cache'}: cannot write in it (Read-only file system)")
    with written_by_another_process(work):  # a second run of the same command, the first still running
        assert_one_line_error(run("scripts/train_drafter.py", *paths, "--out", str(out), "--force", *small),
                              f"--work {work}: in use by another running train_drafter.py")


def test_train_drafter_bad_values_are_one_line(tmp_path, run, beam_mini):
    assert_one_line_error(run("scripts/train_drafter.py", "--steps", "0"), "--steps must be >= 1")
    assert_one_line_error(run("scripts/train_drafter.py", "--eval-block-size", "20"), "--eval-block-size 20")
    assert_one_line_error(run("scripts/train_drafter.py", "--target", str(tmp_path / "nope")), "nope", "config.json")
    assert_one_line_error(run("scripts/train_drafter.py", "--prompts", "0"), "--prompts must be >= 1")
    assert_one_line_error(run("scripts/train_drafter.py", "--prompts", str(10**9)), "--prompts must be at most")
    assert_one_line_error(run("scripts/train_drafter.py", "--layers", "3000"), "--layers must be at most 64")
    assert_one_line_error(run("scripts/train_drafter.py", "--extra-data", str(tmp_path / "gone")), "gone",
                          "no such directory")
    assert_one_line_error(run("scripts/train_drafter.py", "--init", str(tmp_path)), "--init", "no config.json")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")  # a RuntimeError traceback on Python 3.10-3.12
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    assert_one_line_error(run("scripts/train_drafter.py", "--init", str(tmp_path / "loop1")),
                          f"{tmp_path / 'loop1'}: a loop of symbolic links")
    # with every folder in tmp_path: a check that stopped working would write nothing into checkpoints/
    paths = ["--target", str(beam_mini)] + [f"--{flag}={tmp_path / flag}" for flag in ("data", "work", "out")]
    assert_one_line_error(run("scripts/train_drafter.py", *paths, "--max-new-tokens", "1"),
                          "--max-new-tokens must be >= 2")
    assert_one_line_error(run("scripts/train_drafter.py", *paths, "--selector-rank", "5000"),
                          "--selector-rank 5000 is above the target's hidden size (576)")
    assert not any(tmp_path.glob("data*"))
    # argparse rejects these (one line too); --steps 0 fails fast should a choice ever become valid
    for flag, value in (("--prompt-mix", "v-none"), ("--head-vocab", "some")):
        assert_one_line_error(run("scripts/train_drafter.py", flag, value, "--steps", "0"),
                              f"argument {flag}: invalid choice: '{value}'")


@pytest.mark.parametrize("command, required", [("build/build_engines.py", ["--precision", "bf16"]),
                                               ("runtime/run.py", []), ("scripts/benchmark.py", []),
                                               ("scripts/export_triton.py", ["--engine-dir", "x", "--out", "y"]),
                                               ("scripts/triton_client.py", [])])
def test_a_bad_flag_is_one_line_without_the_usage(command, required):
    """argparse's own errors (here an unknown flag) take the one-line form too: the usage block stays in --help."""
    proc = run_script(command, *required, "--no-such-flag")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: unrecognized arguments: --no-such-flag (see {Path(command).name} --help)"], proc.stderr


def test_a_message_after_a_progress_bar_starts_its_own_line(capsys):
    """A bar still drawing when a command fails or is interrupted is closed first: the message is the last line."""
    from tqdm import tqdm

    from beamtrt.cli_util import run_cli

    def fail(exc):
        def body():
            tqdm(total=10, desc="work").update(3)  # left open, as a bar is when its loop raises
            raise exc
        return body

    assert run_cli(fail(ValueError("disk full"))) == 2
    assert capsys.readouterr().err.endswith("]\nerror: disk full\n")
    assert run_cli(fail(KeyboardInterrupt())) == 130
    assert capsys.readouterr().err.endswith("]\ninterrupted\n")


def test_ctrl_c_as_the_command_ends_is_interrupted_not_a_traceback(capsys, monkeypatch):
    """A Ctrl-C landing after the work, while run_cli restores the signal handlers, was a traceback."""
    import signal

    from beamtrt.cli_util import run_cli

    set_handler, calls = signal.signal, []
    originals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def late_ctrl_c(sig, handler):
        calls.append(sig)
        if len(calls) == 3:  # SIGTERM and SIGHUP installed, then the first restored
            raise KeyboardInterrupt
        return set_handler(sig, handler)

    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.SIG_DFL)
    monkeypatch.setattr(signal, "signal", late_ctrl_c)
    assert run_cli(lambda: None) == 130
    monkeypatch.undo()
    for sig, handler in originals.items():  # the one left unrestored by the test's own interruption
        signal.signal(sig, handler)
    assert capsys.readouterr().err == "interrupted\n"


def test_child_error_finds_the_childs_own_line():
    """bench_tp.py / bench_convert.py / the plugin library build report why a build or a run failed: its error line
    even when Open MPI's notice follows it, a compiler's or CMake's first error before make's closing lines, its last
    line otherwise, and how it ended when it printed nothing (killed)."""
    from beamtrt.cli_util import child_error

    assert child_error("loading\nerror: rank 1: bad mask\n----\nprterun noticed that process rank 1\x00\n", 2) == \
        "rank 1: bad mask"
    assert child_error("Traceback ...\nValueError: boom\n", 1) == "ValueError: boom"
    assert child_error("[ 50%] Building\nk.cpp:5:10: fatal error: x.h: No such file\ncc1plus: all warnings\n"
                       "gmake: *** [all] Error 2\n", 2) == "k.cpp:5:10: fatal error: x.h: No such file"
    assert child_error("CMake Error at CMakeLists.txt:3 (find_package): no CUDA\n-- Configuring incomplete\n", 1) == \
        "CMake Error at CMakeLists.txt:3 (find_package): no CUDA"
    assert child_error("", -9) == "killed by signal 9" and child_error("  \n", 3) == "exit status 3, no output"


def test_a_drafter_for_another_target_is_refused_before_the_target_loads(tmp_path, run, monkeypatch):
    """The drafter's config is checked against the target's config before any weight is read (on a large target
    the load takes minutes)."""
    from beamtrt.models import beam

    assert run("scripts/make_random_beam.py", "--out", str(tmp_path / "m"), "--layers", "2").returncode == 0
    monkeypatch.setattr(beam, "load_beam", lambda *a, **k: pytest.fail("the target's weights were loaded"))
    drafter = ROOT / "checkpoints" / "beam-mini-dflash2"
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path / "m"), "--drafter", str(drafter),
                              "--prompt", "hi"), f"{drafter / 'config.json'}: drafter ")


def test_a_block_above_the_drafters_is_refused_before_the_target_loads(mini_vocab_sources, tmp_path, run, monkeypatch):
    """run.py refused it after the weights loaded; benchmark.py after a whole plain-decoding pass."""
    from beamtrt.models import beam

    monkeypatch.setattr(beam, "load_beam", lambda *a, **k: pytest.fail("the target's weights were loaded"))
    src = mini_vocab_sources
    models = ["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--block-size", "20"]
    needle = "--block-size 20 is above the drafter's own block (16)"
    assert_one_line_error(run("runtime/run.py", *models, "--prompt", "hi"), needle)
    assert_one_line_error(run("scripts/benchmark.py", *models, "--families", "chat", "--prompts",
                              f"chat={src / 'prompts.jsonl'}", "--out", str(tmp_path / "b")), needle)


def test_a_failed_copy_of_many_files_is_one_line():
    """shutil.copytree gathers its failures into one shutil.Error (an OSError without strerror): its message was the
    repr of the whole list, 3 KB for one full disk."""
    from beamtrt.cli_util import error_line

    why = "[Errno 28] No space left on device: '/r/.tmp-x/engine/rank0.safetensors'"
    failures = [(f"/b/rank{r}.safetensors", f"/r/.tmp-x/engine/rank{r}.safetensors", why) for r in range(4)]
    assert error_line(shutil.Error(failures)) == f"copying /b/rank0.safetensors: {why} (and 3 more files)"
    assert error_line(shutil.Error(failures[:1])) == f"copying /b/rank0.safetensors: {why}"
    assert error_line(shutil.Error("src and dst are the same file")) == "src and dst are the same file"


def test_a_full_disk_while_copying_names_the_copy_not_its_source(tmp_path, monkeypatch):
    """shutil.copyfile's error names its source first and its destination second: a build that filled its disk
    copying the drafter's draft_vocab.json said that the source checkpoint had no space left."""
    import errno
    import os

    from beamtrt.cli_util import error_line

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    (tmp_path / "src").write_bytes(b"x" * 100)
    monkeypatch.setattr(os, "sendfile", full)
    monkeypatch.setattr(shutil, "_USE_CP_SENDFILE", True)  # Linux's copyfile path (3.14's copy_file_range: off)
    monkeypatch.setattr(shutil, "_USE_CP_COPY_FILE_RANGE", False, raising=False)
    with pytest.raises(OSError) as info:
        shutil.copyfile(tmp_path / "src", tmp_path / "dst")
    assert error_line(info.value) == f"{tmp_path / 'dst'}: No space left on device"
    missing = OSError(errno.ENOENT, os.strerror(errno.ENOENT), str(tmp_path / "gone"), None, str(tmp_path / "dst"))
    assert error_line(missing) == f"{tmp_path / 'gone'}: No such file or directory"  # the source's fault: its name


@pytest.mark.parametrize("sig, ending, session", [(signal.SIGINT, "interrupted", False),
                                                  (signal.SIGTERM, "terminated", False),
                                                  (signal.SIGTERM, "terminated", True)])
def test_an_interrupted_benchmark_waits_for_its_child_to_clean_up(tmp_path, sig, ending, session):
    """bench_tp.py and bench_convert.py run builds as child commands: a signal to the benchmark alone left its build
    running on (bench_convert), and Ctrl-C killed it a quarter of a second later, before it removed its temporary
    folder (bench_tp). The child now gets the signal and is waited for. A child in a session of its own (bench_tp's
    mpirun jobs) gets it with its process group: given to scripts/mpirun alone, the ranks ran on, orphaned."""
    child = ("import pathlib, signal, subprocess, sys, time\n"
             "def done(n, f):\n    time.sleep(1); pathlib.Path(sys.argv[1]).write_text('cleaned'); sys.exit(130)\n"
             "signal.signal(signal.SIGINT, done); signal.signal(signal.SIGTERM, done)\n"
             "if len(sys.argv) > 2:  # a rank of the job, in its process group\n"
             "    subprocess.Popen([sys.executable, sys.argv[0], sys.argv[2]])\n"
             "    while not pathlib.Path(sys.argv[2]).with_name('ready').exists(): time.sleep(0.05)\n"
             "    pathlib.Path(sys.argv[2]).with_name('ready').rename(pathlib.Path(sys.argv[2]).with_name('rank'))\n"
             "pathlib.Path(sys.argv[1]).with_name('ready').write_text('ready'); time.sleep(60)\n")
    (tmp_path / "child.py").write_text(child)
    rank = [str(tmp_path / "rank-cleaned")] if session else []
    parent = (f"import sys; sys.path[:0] = [{str(ROOT / 'src')!r}]\n"
              "from beamtrt.cli_util import run_child, run_cli\n"
              f"sys.exit(run_cli(lambda: run_child([sys.executable, {str(tmp_path / 'child.py')!r}, "
              f"{str(tmp_path / 'cleaned')!r}, *{rank!r}], start_new_session={session})))\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():  # the child's handlers are set (a fixed wait could end before, when busy)
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(sig)  # to the parent alone, as kill PID does
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (128 + sig, f"{ending}\n")
    assert (tmp_path / "cleaned").read_text() == "cleaned"  # the child finished its clean-up before the parent ended
    if session:
        deadline = time.monotonic() + 30
        while not (tmp_path / "rank-cleaned").exists():  # the rank got the signal too (not waited for: a grandchild)
            assert time.monotonic() < deadline, "the rank was left running"
            time.sleep(0.05)
