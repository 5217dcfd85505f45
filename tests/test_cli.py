"""The entry scripts: --help documents every flag; bad input gives one line and exit code 2; run.py generates."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize("script, flags", [
    ("runtime/run.py", ["--engine-dir", "--concurrency", "--model", "--drafter", "--prompt", "--prompts", "--max-new-tokens", "--temperature",
                        "--top-p", "--top-k", "--stop", "--block-size", "--no-spec", "--seed", "--json", "--backend",
                        "--dtype", "--device",
                        "--threads", "--quiet"]),
    ("scripts/make_beam_mini.py", ["--out", "--num-experts", "--top-k", "--perturbation", "--dtype", "--seed",
                                   "--force"]),
    ("scripts/make_random_beam.py", ["--out", "--hidden-size", "--layers", "--experts", "--top-k", "--dtype",
                                     "--max-shard-gb"]),
    ("build/build_engines.py", ["--precision", "--model", "--drafter", "--tp", "--moe-ep", "--kv-cache",
                                "--drafter-precision", "--calib-prompts", "--calib-samples", "--out", "--force",
                                "--quiet"]),
    ("scripts/bench_decode.py", ["--model", "--dtypes", "--batches", "--context", "--steps", "--threads", "--json"]),
    ("scripts/bench_spec.py", ["--model", "--drafter", "--batches", "--block-size", "--max-new-tokens", "--dtype",
                               "--threads", "--json"]),
])
def test_help_lists_every_flag(script, flags):
    proc = run(script, "--help")
    assert proc.returncode == 0
    for flag in flags:
        assert flag in proc.stdout


def test_run_bad_values_are_one_line(tmp_path):
    assert_one_line_error(run("runtime/run.py", "--max-new-tokens", "0"), "--max-new-tokens")
    assert_one_line_error(run("runtime/run.py", "--temperature", "-1"), "temperature")
    assert_one_line_error(run("runtime/run.py", "--top-p", "1.5"), "top_p")
    assert_one_line_error(run("runtime/run.py", "--block-size", "1"), "--block-size")
    assert_one_line_error(run("runtime/run.py", "--stop", ""), "--stop")
    assert_one_line_error(run("runtime/run.py", "--json", str(tmp_path / "no" / "x.json")), "--json")
    assert_one_line_error(run("runtime/run.py", "--prompts", str(tmp_path / "missing.jsonl")), "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"prompt": 3}\n')
    assert_one_line_error(run("runtime/run.py", "--prompts", str(tmp_path / "bad.jsonl")), "bad.jsonl:2")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "hi"\n')
    assert_one_line_error(run("runtime/run.py", "--prompts", str(tmp_path / "broken.jsonl")), "broken.jsonl:1")
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path / "nope")), "nope", "config.json")
    assert_one_line_error(run("runtime/run.py", "--concurrency", "-1"), "--concurrency")
    assert_one_line_error(run("runtime/run.py", "--engine-dir", str(tmp_path / "none")), "none", "manifest.json")
    assert_one_line_error(run("runtime/run.py", "--engine-dir", str(tmp_path), "--model", str(tmp_path)),
                          "cannot be combined")
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    assert_one_line_error(run("runtime/run.py", "--model", str(tmp_path)), "not valid JSON")


def test_random_beam_bad_values_are_one_line(tmp_path):
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--top-k", "9"),
                          "num_experts_per_tok=9")
    assert_one_line_error(run("scripts/make_random_beam.py", "--out", str(tmp_path / "x"), "--heads", "7"),
                          "num_key_value_heads=4")
    assert not (tmp_path / "x").exists()


def test_make_beam_mini_bad_values_are_one_line(tmp_path):
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m"), "--top-k", "5"), "--top-k")
    assert_one_line_error(run("scripts/make_beam_mini.py", "--out", str(tmp_path / "m"), "--perturbation", "-1"),
                          "--perturbation")
    assert not (tmp_path / "m").exists()


def test_random_checkpoint_runs_with_its_own_model(tmp_path):
    out = tmp_path / "rb"
    proc = run("scripts/make_random_beam.py", "--out", str(out), "--layers", "2", "--max-shard-gb", "0.001")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors.index.json").is_file()
    from beamtrt.models.beam import load_beam

    model = load_beam(out)
    cache = model.new_cache(1, 8)
    import torch

    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]), cache).logits).all()


@pytest.mark.slow
def test_run_generates_coherent_text(beam_mini):
    proc = run("runtime/run.py", "--model", str(beam_mini), "--prompt", "What is the capital of France?",
               "--max-new-tokens", "16", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr


def test_bench_bad_values_are_one_line(tmp_path):
    assert_one_line_error(run("scripts/bench_decode.py", "--model", str(tmp_path), "--batches", "0"), "--batches")
    assert_one_line_error(run("scripts/bench_spec.py", "--model", str(tmp_path), "--batches", "99"), "--batches")
    assert_one_line_error(run("scripts/bench_decode.py", "--model", str(tmp_path / "nope")), "nope")
