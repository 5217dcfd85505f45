"""build_engines.py end to end on tiny random checkpoints: outputs, manifest, idempotency, atomicity, bad input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from beamtrt.checkpoint.manifest import read_manifest
from beamtrt.config import BeamConfig, BuildConfig, DrafterConfig
from beamtrt.errors import CheckpointError
from beamtrt.models.beam import load_beam
from beamtrt.models.dflash2 import random_drafter, save_drafter
from beamtrt.models.random_beam import write_random_beam
from test_cli import assert_one_line_error as one_line_error

ROOT = Path(__file__).resolve().parents[1]
CFG = BeamConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                 mlp_only_layers=(0,), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    write_random_beam(root / "target", CFG)
    target = load_beam(root / "target")
    drafter = DrafterConfig.for_target(CFG, num_hidden_layers=1, target_layer_ids=(0, 2), mask_token_id=0)
    save_drafter(random_drafter(drafter, target), root / "drafter")
    return root


def build(sources: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "build/build_engines.py"), "--model", str(sources / "target"),
           "--drafter", str(sources / "drafter"), "--out", str(out), "--quiet", "--tp", "2", *args]
    if "--precision" not in args:
        cmd += ["--precision", "bf16"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def no_leftovers(parent: Path) -> None:
    assert not [p for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_build_writes_checkpoints_manifest_and_skips_engines(sources, tmp_path):
    out = tmp_path / "bf16-tp2"
    proc = build(sources, out)
    assert proc.returncode == 0, proc.stderr
    assert "engines: skipped (TensorRT-LLM is not installed on this host)" in proc.stderr
    assert f"warning: {sources / 'target'} has no tokenizer files" in proc.stderr  # a random model: converted anyway
    assert "target   Qwen3MoeForCausalLM: 2 rank file(s)" in proc.stdout and "sha256 verified" in proc.stdout
    assert sorted(p.name for p in (out / "target").iterdir()) == ["config.json", "rank0.safetensors",
                                                                  "rank1.safetensors"]
    m = read_manifest(out)
    assert m["precision"] == "bf16" and m["mapping"]["tp_size"] == 2
    assert m["drafter"]["target_layer_ids"] == [0, 2] and m["drafter"]["block_size"] == 8
    assert {k: v["status"] for k, v in m["stages"].items()} == {"calibrate": "skipped", "target": "ran",
                                                               "drafter": "ran", "engines": "skipped"}
    assert set(m["files"]) == {"target/config.json", "target/rank0.safetensors", "target/rank1.safetensors",
                               "drafter/config.json", "drafter/rank0.safetensors", "drafter/rank1.safetensors"}
    no_leftovers(tmp_path)


def test_rebuild_is_idempotent_and_settings_changes_need_force(sources, tmp_path):
    out = tmp_path / "out"
    assert build(sources, out).returncode == 0
    inode = (out / "target" / "rank0.safetensors").stat().st_ino
    again = build(sources, out)
    assert again.returncode == 0 and "up to date" in again.stderr
    assert re.search(r"\n  stage target +done in \d+\.\d s\n", again.stdout)  # by the build that made it ("ran" read
    assert not re.search(r"\bran\b", again.stdout)                              # as if this command had run it)
    assert (out / "target" / "rank0.safetensors").stat().st_ino == inode
    (out / "notes.txt").write_text("mine")  # up to date, but no longer valid: it said both, and --force did not help
    stray = build(sources, out)
    one_line_error(stray, f"{out / 'notes.txt'}: not listed in manifest.json", "pass --force to write it again")
    assert "nothing to do" not in stray.stderr
    rewritten = build(sources, out, "--force")
    assert rewritten.returncode == 0, rewritten.stderr
    assert not (out / "notes.txt").exists() and (out / "target" / "rank0.safetensors").stat().st_ino == inode

    changed = build(sources, out, "--kv-cache", "fp8")
    one_line_error(changed, "already exists and was built from other inputs or settings (--kv-cache auto (now "
                   "fp8))", "--force")  # it said "(stage calibrate differs)": which flag, the user had to guess
    assert read_manifest(out)["kv_cache"] == "auto"  # untouched

    forced = build(sources, out, "--kv-cache", "fp8", "--force")
    assert forced.returncode == 0, forced.stderr
    m = read_manifest(out)
    assert m["kv_cache"] == "fp8" and m["stages"]["drafter"]["status"] == "reused"
    assert m["stages"]["calibrate"]["status"] == m["stages"]["target"]["status"] == "ran"
    assert "\n  stage drafter   reused from an earlier build\n" in forced.stdout
    no_leftovers(tmp_path)


def test_the_validator_shows_its_hashing(sources, tmp_path, monkeypatch):
    """python -m beamtrt.checkpoint.validate hashes every file of a build without a word (hours on Beam): a bar over
    the bytes, on a terminal, now moves as it goes."""
    from beamtrt import cli_util
    from beamtrt.checkpoint import validate

    out = tmp_path / "out"
    assert build(sources, out).returncode == 0
    bars = []

    class Bar:
        def __init__(self, total, desc, unit, scale):
            self.total, self.done, self.closed = total, 0, False
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(cli_util, "progress", lambda total, desc, unit, scale: Bar(total, desc, unit, scale))
    assert validate.main([str(out)]) == 0
    sizes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert [(b.total, b.done, b.closed) for b in bars] == [(sizes, sizes, True)]


def test_a_rebuild_with_nothing_to_do_reads_each_weight_file_once(sources, tmp_path, monkeypatch):
    """An up-to-date rerun checks each stage's files against their sha256, then validates the output: that hashed
    every rank file a second time (four reads of the model where two do, minutes on Beam)."""
    from beamtrt.build.pipeline import build as run_build
    from beamtrt.checkpoint import manifest
    from beamtrt.config import BuildConfig

    bc = BuildConfig(model=sources / "target", drafter=sources / "drafter", out=tmp_path / "out", precision="bf16",
                     tp=2)
    run_build(bc, progress=False)
    hashed, sha256_file = [], manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda path: hashed.append(Path(path)) or sha256_file(path))
    run_build(bc, progress=False)
    ranks = sorted(str(p.relative_to(bc.out)) for p in hashed if p.name.startswith("rank"))
    assert ranks == [f"{part}/rank{r}.safetensors" for part in ("drafter", "target") for r in (0, 1)], ranks


def test_engine_settings_are_recorded_and_changes_need_force(sources, tmp_path):
    """The engine limits are part of the build even where no engine is built: the manifest records them, and a
    change needs --force (every stage is then reused, the manifest rewritten)."""
    out = tmp_path / "out"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    first = build(sources, out, "--calib-prompts", str(prompts))  # bf16: nothing to calibrate, and it says so
    assert first.returncode == 0 and "warning: --calib-prompts is not used" in first.stderr
    assert read_manifest(out)["engines"]["settings"]["block_size"] == 8
    one_line_error(build(sources, out, "--block-size", "4", "--tp", "1"), "settings (--block-size 8 (now 4), --tp 2 "
                   "(now 1))", "--force")
    forced = build(sources, out, "--block-size", "4", "--max-batch-size", "16", "--force")
    assert forced.returncode == 0, forced.stderr
    m = read_manifest(out)
    assert m["engines"]["settings"] == {"max_batch_size": 16, "max_seq_len": CFG.max_position_embeddings,
                                        "max_num_tokens": 8192, "block_size": 4}
    assert m["drafter"]["block_size"] == 4 and m["stages"]["target"]["status"] == "reused"
    one_line_error(build(sources, out, "--max-num-tokens", "10", "--force"), "cannot hold one verify step")
    positions = CFG.max_position_embeddings  # the default, and the most the engines take
    one_line_error(build(sources, out, "--max-seq-len", str(positions + 1), "--force"),
                   f"--max-seq-len {positions + 1} is past the target's {positions} positions", "leave it out")
    trained = m["drafter"]["train_block_size"]
    one_line_error(build(sources, out, "--block-size", str(trained + 1), "--force"),
                   f"--block-size {trained + 1} is above the drafter's own block ({trained})")


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_quantized_build_validates(sources, tmp_path, precision):
    out = tmp_path / precision
    proc = build(sources, out, "--precision", precision, "--calib-samples", "3")
    assert proc.returncode == 0, proc.stderr
    calib = json.loads((out / "calibration.json").read_text())
    assert calib["samples"] == 3 and "random token ids" in calib["source"]
    assert all(v > 0 for v in calib["amax"].values())
    assert "quantized weight tensors per rank: OK" in proc.stdout


def test_fp8_drafter_is_calibrated_and_quantized(sources, tmp_path):
    out = tmp_path / "out"
    proc = build(sources, out, "--drafter-precision", "fp8", "--calib-samples", "2")
    assert proc.returncode == 0, proc.stderr
    calib = json.loads((out / "calibration.json").read_text())
    assert set(calib["drafter_amax"]) == {f"transformer.layers.0.{s}" for s in
                                          ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj")}
    assert "bf16 target, fp8 drafter" in proc.stdout
    assert "drafter  DFlash2DraftModel: 2 rank file(s) × 29 tensors" in proc.stdout  # bf16: 19, + 2 scales per GEMM
    assert "5 quantized weight tensors per rank: OK" in proc.stdout
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["quantization"]["quant_algo"] == "FP8"
    assert read_manifest(out)["stages"]["calibrate"]["status"] == "ran"  # bf16 target, fp8 drafter


def test_validate_catches_a_modified_file(sources, tmp_path):
    out = tmp_path / "out"
    assert build(sources, out).returncode == 0
    cmd = [sys.executable, "-m", "beamtrt.checkpoint.validate", str(out)]
    env = {"PYTHONPATH": str(ROOT / "src")}
    ok = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert ok.returncode == 0 and "sha256 verified" in ok.stdout, ok.stderr
    with open(out / "drafter" / "rank1.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x7f\x7f\x7f\x7f")
    bad = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    one_line_error(bad, "rank1.safetensors", "sha256 differs")
    one_line_error(build(sources, out), "files of its stage drafter were changed or removed", "--force")
    assert build(sources, out, "--force").returncode == 0
    assert subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120).returncode == 0
    (out / "drafter" / "rank1.safetensors").unlink()
    (out / "drafter" / "rank1.safetensors").mkdir()  # was 'listed in manifest.json but missing'
    one_line_error(subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120),
                   f"{out / 'drafter' / 'rank1.safetensors'}: listed in manifest.json but a directory")


def _corrupt_copy(sources: Path, tmp_path: Path, edit) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(sources, dst)
    edit(dst)
    return dst


def _rewrite(path: Path, name: str, fn) -> None:
    from safetensors.torch import load_file, save_file
    file = next(p for p in path.glob("*.safetensors"))
    tensors = load_file(file)
    fn(tensors, name)
    save_file(tensors, file, metadata={"format": "pt"})


def _overflowing_float16(tensors: dict, name: str) -> None:
    """An fp16 embedding (the dtype a build writes) beside an fp32 tensor beyond fp16's range: the build named its
    output rank file ('has NaN or Inf values'), not the source tensor."""
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].half()
    tensors[name] = tensors[name].float()
    tensors[name].view(-1)[7] = 1e5


@pytest.mark.parametrize("edit, needles", [
    (lambda d: _rewrite(d / "target", "model.layers.1.mlp.gate.weight", lambda t, n: t.pop(n)),
     ["missing 1 tensor", "model.layers.1.mlp.gate.weight"]),
    (lambda d: _rewrite(d / "target", "model.layers.2.self_attn.o_proj.weight",
                        lambda t, n: t.__setitem__(n, t[n][:, :32].contiguous())),
     ["o_proj.weight", "shape (64, 32), expected (64, 64)"]),
    (lambda d: _rewrite(d / "target", "model.layers.2.mlp.experts.1.up_proj.weight",
                        lambda t, n: t[n].view(-1).__setitem__(5, float("nan"))),
     ["experts.1.up_proj.weight", "NaN"]),
    (lambda d: (d / "target" / "config.json").write_text("{not json"), ["config.json", "not valid JSON"]),
    (lambda d: _rewrite(d / "target", "model.layers.1.self_attn.q_proj.weight",  # FP8 without its scales: a traceback
                        lambda t, n: t.__setitem__(n, t[n].to(torch.float8_e4m3fn))),
     ["q_proj.weight", "float8_e4m3fn, expected a floating-point dtype of 16 bits or more (an FP8 checkpoint"]),
    (lambda d: (d / "target" / "generation_config.json").write_text('{"eos_token_id": "2"}'),  # the runtime's stops
     ["generation_config.json: eos_token_id must be a token id or a list of them, got '2'"]),
    (lambda d: _rewrite(d / "target", "model.layers.2.self_attn.o_proj.weight", _overflowing_float16),
     ["o_proj.weight: values up to 1e+05 overflow float16, the dtype the build writes"]),
    (lambda d: _rewrite(d / "target", "model.embed_tokens.weight", lambda t, n: t.__setitem__(n, t[n].double())),
     ["unsupported weight dtype torch.float64 (its embedding's; a build reads bfloat16, float16, float32)"]),
    (lambda d: _rewrite(d / "drafter", "fc.weight", lambda t, n: t.__setitem__(n, t[n].double())),  # was cast to bf16
     ["drafter: unsupported weight dtype torch.float64 (its fc's; a build reads bfloat16, float16, float32)"]),
], ids=["missing", "mis-shaped", "nan", "corrupt-json", "fp8", "generation-config", "overflow", "float64",
        "drafter-float64"])
def test_bad_target_gives_one_line_and_no_output(sources, tmp_path, edit, needles):
    src = _corrupt_copy(sources, tmp_path, edit)
    out = tmp_path / "out"
    one_line_error(build(src, out), *needles)
    assert not out.exists()
    no_leftovers(tmp_path)


def test_an_all_zero_expert_builds_with_a_warning(sources, tmp_path):
    """A pruned expert (all-zero weights) is quantized to zeros with modelopt's zero-range scale and named in a
    warning (a zero scale failed the build after calibration, naming no tensor); so is an activation calibration
    never saw non-zero, the input of a dense down_proj whose gate_proj is zeros (it failed the build)."""
    name, gate = "model.layers.2.mlp.experts.1.down_proj.weight", "model.layers.0.mlp.gate_proj.weight"

    def zero(d: Path) -> None:
        for n in (name, gate):
            _rewrite(d / "target", n, lambda t, n: t[n].zero_())

    src = _corrupt_copy(sources, tmp_path, zero)
    proc = build(src, tmp_path / "out", "--precision", "fp8", "--calib-samples", "2")
    assert proc.returncode == 0, proc.stderr
    assert f"warning: {name}: all zeros; quantized to zeros with the scale of amax 448" in proc.stderr
    assert "warning: calibration never saw transformer.layers.0.mlp.proj non-zero; its scale" in proc.stderr


@pytest.mark.parametrize("field, value, needles", [
    ("hidden_size", 32, ["does not fit target", "hidden_size"]),
    ("vocab_size", 100, ["does not fit target", "vocab_size=100"]),
    ("dflash_config", {"mask_token_id": 0, "target_layer_ids": [4, 46], "block_size": 16},
     ["does not fit target", "num_target_layers=48 != target num_hidden_layers=3"]),
])
def test_drafter_target_mismatch(sources, tmp_path, field, value, needles):
    def edit(d: Path) -> None:  # the last case: a drafter made for a 48-layer target, tapping layers 4 and 46
        cfg = json.loads((d / "drafter" / "config.json").read_text())
        cfg[field] = value
        if field == "dflash_config":
            cfg["num_target_layers"] = 48
        (d / "drafter" / "config.json").write_text(json.dumps(cfg))
    src = _corrupt_copy(sources, tmp_path, edit)
    one_line_error(build(src, tmp_path / "out"), *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, needles", [
    (["--tp", "3"], ["TP 3 does not divide the target's 4 attention heads"]),
    (["--tp", "4", "--moe-ep", "4", "--precision", "bf16"], []),  # 4 experts over 4 ranks: fine
    (["--tp", "2", "--moe-ep", "3"], ["--moe-ep 3 must divide --tp 2"]),
    (["--calib-samples", "0"], ["--calib-samples must be in [1, 4096]"]),
    (["--calib-samples", "1000000000"], ["--calib-samples must be in [1, 4096]"]),
    (["--precision", "fp8", "--calib-prompts", "/nonexistent/p.jsonl"], ["p.jsonl: cannot read the prompts file"]),
])
def test_bad_layouts(sources, tmp_path, args, needles):
    proc = build(sources, tmp_path / "out", *args)
    if not needles:
        assert proc.returncode == 0, proc.stderr
        return
    one_line_error(proc, *needles)
    assert not (tmp_path / "out").exists()


def test_an_existing_foreign_directory_is_never_replaced(sources, tmp_path):
    """--force replaces a build; a folder of anything else at --out (a typo's home folder, a checkpoint) was deleted
    whole with --force. It is refused either way; an empty folder is written into."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for force in ((), ("--force",)):
        one_line_error(build(sources, out, *force), "exists and is not a build output", "empty it first")
        assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert build(sources, out).returncode == 0 and (out / "manifest.json").is_file()
    app = tmp_path / "app"  # another program's folder with a manifest.json of its own: taken for a damaged build
    app.mkdir()
    (app / "manifest.json").write_text('{"name": "my-web-app"}')
    (app / "index.html").write_text("mine")
    one_line_error(build(sources, app, "--force"), "is not a build output (it holds index.html, which a build does "
                                                   "not write)")
    assert sorted(p.name for p in app.iterdir()) == ["index.html", "manifest.json"]


@pytest.mark.parametrize("manifest, needle", [('{"format_version": 0}', "format_version 0 is not this version's 1"),
                                             ('{"format_version": 1,', "build manifest is not valid JSON")])
def test_an_old_or_unreadable_output_needs_force(sources, tmp_path, manifest, needle):
    """An --out whose manifest.json an older version wrote, or that is not JSON, says --force replaces it (it said
    'rebuild with this version of build_engines.py', the command just run)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(manifest)
    one_line_error(build(sources, out), f"{out / 'manifest.json'}: ", needle, "--force to replace")
    assert (out / "manifest.json").read_text() == manifest
    if "format_version" in needle:
        assert build(sources, out, "--force").returncode == 0 and read_manifest(out)["format_version"] == 1


def test_out_that_is_the_working_directory_is_refused(sources, tmp_path):
    cmd = [sys.executable, str(ROOT / "build/build_engines.py"), "--model", str(sources / "target"), "--drafter",
           str(sources / "drafter"), "--precision", "bf16", "--tp", "1", "--quiet", "--force"]
    for out, cwd in ((".", tmp_path), ("..", tmp_path / "sub")):
        cwd.mkdir(exist_ok=True)
        proc = subprocess.run([*cmd, "--out", out], capture_output=True, text=True, timeout=300, cwd=cwd)
        one_line_error(proc, f"--out {out}: is the current directory or holds it")
    assert [p.name for p in tmp_path.iterdir()] == ["sub"] and not any((tmp_path / "sub").iterdir())


def test_out_that_holds_a_source_or_sits_under_a_file_is_refused(sources, tmp_path):
    """--force replaces --out: an --out that is, or contains, the model or the drafter would delete it."""
    src = _corrupt_copy(sources, tmp_path, lambda d: None)
    for out, flag in ((src / "target", "--model"), (src, "--model"), (src / "drafter", "--drafter")):
        one_line_error(build(src, out, "--force"), f"--out {out} holds the {flag} input")
    for out, flag in ((src / "target" / "out", "--model"), (src / "drafter" / "a" / "b", "--drafter")):
        one_line_error(build(src, out), f"--out {out} is inside the {flag} input")  # a source read whole
    names = [sorted(p.name for p in (root / "drafter").iterdir()) for root in (src, sources)]
    assert names[0] == names[1]
    assert (src / "target" / "config.json").is_file() and not (src / "target" / "out").exists()
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    for args in (["--out", str(tmp_path / "loop1")], ["--model", str(tmp_path / "loop1")]):
        one_line_error(build(src, tmp_path / "out", *args), f"{tmp_path / 'loop1'}: a loop of symbolic links")
    (tmp_path / "afile").write_text("")
    one_line_error(build(src, tmp_path / "afile" / "out"), "afile is a file, not a directory")


def test_a_build_loads_only_tensors_it_could_have_written(sources, tmp_path):
    """run.py's loaders read rank files without hashing them: each tensor is checked against the name table (shape,
    dtype), for NaN / Inf and for positive scales as it is read; a manifest lacking what the loaders read is named."""
    from beamtrt.checkpoint.trtllm_files import load_target
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    assert build(sources, out).returncode == 0, "build"
    rank0 = out / "target" / "rank0.safetensors"
    good = load_file(rank0)
    name = next(n for n in good if n.endswith("attention.qkv.weight"))
    for edit, needle in ((lambda t: t[name].view(-1).__setitem__(3, float("nan")), "has NaN or Inf values"),
                         (lambda t: t.__setitem__(name, t[name][1:].contiguous()), "expected")):
        tensors = dict(good)
        tensors[name] = good[name].clone()
        edit(tensors)
        save_file(tensors, rank0, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=needle) as info:
            load_target(out / "target")
        assert name in str(info.value) and "rank0.safetensors" in str(info.value)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["mapping"]["tp_size"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="lacks 'mapping.tp_size'"):
        read_manifest(out)
    with pytest.raises(CheckpointError, match="no such directory"):
        read_manifest(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="is not a build/build_engines.py output"):
        read_manifest(out / "target")


def test_one_process_reads_every_ranks_copy_of_the_activation_scales(sources, tmp_path):
    """Every rank file holds the same activation and KV-cache scales; one process running them all used rank 0's and
    never read the others, so a damaged copy (which that rank would use under mpirun) went unnoticed."""
    from beamtrt.checkpoint.trtllm_files import load_target
    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    assert build(sources, out, "--precision", "fp8", "--kv-cache", "fp8").returncode == 0, "build"
    load_target(out / "target")
    rank1 = out / "target" / "rank1.safetensors"
    good = load_file(rank1)
    for suffix in ("mlp.proj.activation_scaling_factor", "attention.kv_cache_scaling_factor"):
        name = next(n for n in good if n.endswith(suffix))
        for value, needle in ((float("nan"), "has NaN or Inf values"), (2.0, "differs from rank 0's copy")):
            tensors = dict(good)
            tensors[name] = good[name] * value
            save_file(tensors, rank1, metadata={"format": "pt"})
            with pytest.raises(CheckpointError, match=needle) as info:
                load_target(out / "target")
            assert str(info.value).startswith(f"{rank1}: ") and name in str(info.value)
    save_file(good, rank1, metadata={"format": "pt"})
    load_target(out / "target")


def test_build_failure_midway_leaves_nothing(sources, tmp_path, monkeypatch):
    """A failure inside a stage (here: the drafter writer) removes the temporary directory; no output appears."""
    from beamtrt.build import pipeline
    from beamtrt.config import BuildConfig

    def boom(*a, **k):
        raise RuntimeError("disk on fire")
    monkeypatch.setattr(pipeline, "_write_drafter", boom)
    bc = BuildConfig(model=sources / "target", drafter=sources / "drafter", out=tmp_path / "out", precision="bf16",
                     tp=2)
    with pytest.raises(RuntimeError, match="disk on fire"):
        pipeline.build(bc, progress=False)
    assert not (tmp_path / "out").exists()
    no_leftovers(tmp_path)


def test_a_build_that_does_not_fit_its_disk_stops_before_calibrating(sources, tmp_path, monkeypatch):
    """The rank files a build writes are known before it calibrates (hours on a large model): a file system without
    room for them is one line, before any output. Measured against the files a build then writes."""
    import shutil

    from beamtrt.build import pipeline
    from beamtrt.config import BuildConfig
    from beamtrt.errors import ConfigError

    bc = BuildConfig(model=sources / "target", drafter=sources / "drafter", out=tmp_path / "a" / "out",
                     precision="nvfp4", tp=2)
    disk_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=10_000))
    monkeypatch.setattr(pipeline, "_calibrate", lambda *a: pytest.fail("calibrated"))
    with pytest.raises(ConfigError) as info:
        pipeline.build(bc, progress=False)
    said = re.fullmatch(rf"{bc.out}: the build writes about (\S+) MB \(target (\S+) MB \+ drafter (\S+) MB\) and "
                        rf"{tmp_path} has 0.0 MB free: free some space or write the build elsewhere", str(info.value))
    assert said, info.value
    assert not (tmp_path / "a").exists()
    monkeypatch.undo()
    pipeline.build(bc, progress=False)
    for part, mb in zip(("target", "drafter"), said.groups()[1:]):
        written = sum(p.stat().st_size for p in (bc.out / part).glob("rank*.safetensors"))
        assert abs(written / 1e6 - float(mb)) <= 0.05 + 0.01 * written / 1e6, (part, written, mb)


def test_a_killed_builds_leftover_is_removed_before_the_space_check(sources, tmp_path, monkeypatch):
    """A build killed outright leaves its hidden staging folder, which the next run removes: the space check came
    first and counted that folder as used, so the rerun refused for lack of the space its removal frees."""
    import shutil

    from beamtrt.build import pipeline
    from beamtrt.config import BuildConfig

    bc = BuildConfig(model=sources / "target", drafter=sources / "drafter", out=tmp_path / "out", precision="bf16",
                     tp=1)
    left = tmp_path / ".out.tmp-killed"
    left.mkdir()
    (left / "rank0.safetensors").write_bytes(b"x" * 1000)
    disk_usage = shutil.disk_usage  # no room while the leftover is there
    monkeypatch.setattr(shutil, "disk_usage", lambda path: disk_usage(path)._replace(free=0 if left.exists() else
                                                                                      disk_usage(path).free))
    pipeline.build(bc, progress=False)
    assert not left.exists() and read_manifest(bc.out)["precision"] == "bf16"


def test_tokenizer_files_are_inputs_and_outputs_take_the_umask(sources, tmp_path):
    """A changed chat template changes the target stage (it is copied into the output and tokenizes calibration);
    outputs get a plain mkdir's and open()'s modes, readable by a tritonserver running as another user."""
    from beamtrt.checkpoint.hf import _UMASK

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(sources / "target", src)
    (src / "chat_template.jinja").write_text("{{ messages }}")
    for name in ("pytorch_model.bin", "README.md", ".gitattributes"):  # neither copied nor inputs of the build
        (src / name).write_text("x")
    assert build(sources, out, "--model", str(src)).returncode == 0
    assert (out / "tokenizer" / "chat_template.jinja").read_text() == "{{ messages }}"
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["chat_template.jinja"]
    (src / "README.md").write_text("a model card, edited")
    assert "up to date" in build(sources, out, "--model", str(src)).stderr
    assert out.stat().st_mode & 0o777 == 0o777 & ~_UMASK
    modes = {f.stat().st_mode & 0o777 for f in out.rglob("*") if f.is_file()}  # weights, configs, tokenizer
    assert modes == {0o666 & ~_UMASK}, modes
    (src / "chat_template.jinja").write_text("{{ messages | length }}")
    one_line_error(build(sources, out, "--model", str(src)), "stage target differs", "--force")
    forced = build(sources, out, "--model", str(src), "--force")
    assert forced.returncode == 0, forced.stderr
    assert (out / "tokenizer" / "chat_template.jinja").read_text() == "{{ messages | length }}"
    assert read_manifest(out)["stages"]["drafter"]["status"] == "reused"


def test_a_draft_vocabulary_added_to_the_drafter_is_an_input(sources, tmp_path):
    """scripts/draft_vocab.py writes draft_vocab.json beside unchanged weights: a rebuild must not call the output up to
    date (dropping the file from the drafter stage's inputs survived the suite), and --force carries it over."""
    import torch

    from beamtrt.models.dflash2 import DRAFT_VOCAB_FILE, write_draft_vocab

    drafter, out = tmp_path / "drafter", tmp_path / "out"
    shutil.copytree(sources / "drafter", drafter)
    assert build(sources, out, "--drafter", str(drafter)).returncode == 0
    assert not (out / "drafter" / DRAFT_VOCAB_FILE).exists()
    write_draft_vocab(drafter, torch.arange(0, CFG.vocab_size, 2))
    one_line_error(build(sources, out, "--drafter", str(drafter)), "stage drafter differs", "--force")
    assert build(sources, out, "--drafter", str(drafter), "--force").returncode == 0
    assert (out / "drafter" / DRAFT_VOCAB_FILE).read_text() == (drafter / DRAFT_VOCAB_FILE).read_text()


def _build_and_edit_manifest(sources: Path, out: Path, edit) -> Path:
    assert build(sources, out).returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["stages"].__setitem__("target", "ran"), "'stages.target' is \"ran\""),
    (lambda m: m["stages"]["target"].__setitem__("files", ["x"]), "'stages.target.files' is"),
    (lambda m: m["mapping"].__setitem__("tp_size", "2"), "'mapping.tp_size' is \"2\""),
    (lambda m: m["drafter"].__setitem__("block_size", True), "'drafter.block_size' is true"),
    (lambda m: m["target"].__setitem__("dir", 5), "'target.dir' is 5"),
    (lambda m: m.__setitem__("engines", "x"), "'engines' is \"x\""),
    (lambda m: m["stages"]["target"].__setitem__("seconds", "x"), "'stages.target.seconds' is \"x\""),
])
def test_a_manifest_of_the_wrong_types_is_one_line_and_force_replaces_it(sources, tmp_path, edit, needle):
    out = _build_and_edit_manifest(sources, tmp_path / "out", edit)
    with pytest.raises(CheckpointError, match=needle):
        read_manifest(out)
    one_line_error(build(sources, out), needle.split(" is")[0], "--force")
    assert build(sources, out, "--force").returncode == 0
    assert read_manifest(out)["stages"]["target"]["status"] == "ran"
    no_leftovers(tmp_path)


def test_a_target_config_that_contradicts_its_weights_is_blamed_not_the_drafter(sources, tmp_path):
    """vocab_size edited in the target's config.json: its own weights disagree first (the build said the drafter
    did not fit the target)."""
    src = tmp_path / "src"
    shutil.copytree(sources / "target", src)
    config = json.loads((src / "config.json").read_text())
    config["vocab_size"] += 8
    (src / "config.json").write_text(json.dumps(config))
    one_line_error(build(sources, tmp_path / "out", "--model", str(src)), "model.embed_tokens.weight' has shape")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("precision", ["fp8", "bf16"])  # bf16 needs no calibration, but decoding needs the tokenizer
@pytest.mark.parametrize("files", [{"tokenizer_config.json": "{}"}, {"tokenizer.json": "not a tokenizer"}])
def test_a_broken_tokenizer_fails_calibration_in_one_line(sources, tmp_path, files, precision):
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(sources / "target", src)
    for name, text in files.items():
        (src / name).write_text(text)
    one_line_error(build(sources, out, "--model", str(src), "--precision", precision, "--calib-samples", "2"),
                   "its tokenizer cannot tokenize the calibration prompts")
    assert not out.exists()
    no_leftovers(tmp_path)


def test_a_broken_chat_template_fails_the_build_in_one_line(mini_vocab_sources, tmp_path):
    """A bf16 build (no calibration) copied a chat template that cannot render, and run.py failed on it later."""
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(mini_vocab_sources / "target", src)
    (src / "chat_template.jinja").write_text("{% if %}")
    one_line_error(build(mini_vocab_sources, out, "--model", str(src)), f"{src}: its tokenizer cannot tokenize")
    assert not out.exists()


def test_an_unquantized_build_says_what_dtype_it_kept(sources, tmp_path):
    """--precision bf16 keeps the checkpoint's dtype: of an fp32 one, the summary read 'bf16 target'; so does
    --drafter-precision bf16 (an fp16 drafter)."""
    import torch

    from beamtrt.models.beam import load_beam
    from beamtrt.models.dflash2 import load_drafter, save_drafter
    from beamtrt.models.random_beam import write_random_beam

    write_random_beam(tmp_path / "fp32", CFG, dtype=torch.float32)
    proc = build(sources, tmp_path / "out", "--model", str(tmp_path / "fp32"))
    assert proc.returncode == 0, proc.stderr
    assert "bf16 target (float32 weights), bf16 drafter (float32 weights), KV cache" in proc.stdout  # random: fp32
    assert read_manifest(tmp_path / "out")["target"]["dtype"] == "float32"
    save_drafter(load_drafter(sources / "drafter", load_beam(sources / "target"), dtype=torch.float16),
                 tmp_path / "fp16")
    proc = build(sources, tmp_path / "out2", "--drafter", str(tmp_path / "fp16"))
    assert proc.returncode == 0, proc.stderr
    assert "bf16 target, bf16 drafter (float16 weights), KV cache" in proc.stdout


def test_a_calibration_prompt_of_no_tokens_is_one_line(mini_vocab_sources, tmp_path):
    """A tokenizer with no chat template and no BOS token makes an empty prompt no tokens at all: calibration ended
    in an IndexError traceback on it."""
    import json

    src, out, prompts = tmp_path / "src", tmp_path / "out", tmp_path / "prompts.jsonl"
    shutil.copytree(mini_vocab_sources / "target", src)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    prompts.write_text('{"prompt": "Hello there."}\n\n{"prompt": ""}\n')
    one_line_error(build(mini_vocab_sources, out, "--model", str(src), "--precision", "fp8", "--calib-samples", "2",
                         "--calib-prompts", str(prompts)),
                   f"{prompts}:3: this calibration prompt is no tokens at all with {src}'s tokenizer")
    assert not out.exists()


@pytest.mark.parametrize("part, edit, needle", [
    ("drafter", lambda c: [d.__setitem__("block_size", 4) for d in (c["drafter_config"],
                                                                     c["drafter_config"]["dflash_config"])],
     "block_size 4 differs from the manifest's drafter.train_block_size 16"),
    ("target", lambda c: c["quantization"].__setitem__("kv_cache_quant_algo", "FP8"),
     "kv_cache fp8 differs from the manifest's kv_cache auto"),
    ("target", lambda c: c["mapping"].update(moe_tp_size=1, moe_ep_size=2), "mapping {"),
])
def test_run_refuses_a_config_changed_since_the_build(sources, tmp_path, part, edit, needle):
    """runtime/run.py does not hash a build's files at every start (the validator does), but reads its two config.json
    files against the manifest: an edited one is named (a drafter block of 4 ran, one of 32 was refused unnamed)."""
    out = tmp_path / "out"
    assert build(sources, out).returncode == 0
    config = json.loads((out / part / "config.json").read_text())
    edit(config)
    (out / part / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(ROOT / "runtime/run.py"), "--engine-dir", str(out), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    one_line_error(proc, f"{out / part / 'config.json'}: {needle}", "rebuild")


@pytest.mark.parametrize("rel, edit", [
    ("drafter/config.json", lambda text: text.replace('"num_hidden_layers": 1', '"num_hidden_layers": 7')),
    ("drafter/draft_vocab.json", lambda text: '{"token_ids": [5, 3]}'),
    ("tokenizer/chat_template.jinja", lambda text: "{{ messages }}"),
])
def test_run_refuses_a_small_file_changed_since_the_build(mini_vocab_sources, tmp_path, rel, edit):
    """Every file of a build but its weights is hashed at every start: an edit the config fields do not show (a
    drafter of other depth, a draft vocabulary, a chat template) is named in one line before any weight loads (it
    failed later, on every rank, blaming a rank file or the vocabulary, or ran with the edit)."""
    out = tmp_path / "out"
    assert build(mini_vocab_sources, out).returncode == 0
    text = (out / rel).read_text()
    assert edit(text) != text
    (out / rel).write_text(edit(text))
    proc = subprocess.run([sys.executable, str(ROOT / "runtime/run.py"), "--engine-dir", str(out), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    one_line_error(proc, f"{out / rel}: sha256 differs from manifest.json", "rebuild")


def test_a_rank_file_of_another_rank_or_build_is_named_before_anything_loads(mini_vocab_sources, tmp_path):
    """Each rank file's header names the build stage and rank that wrote it, checked at every start: a rank file
    copied over another rank's, or from another build, is one line (each ran, giving other tokens, one process and
    mpirun ranks different ones). The weights are not hashed at a start. Rank files written before the stamps pass,
    also beside stamped ones (a stage reused by a rebuild with --force keeps its files as they were)."""
    from safetensors.torch import load_file, save_file

    from beamtrt.checkpoint.validate import agree

    out = tmp_path / "out"
    assert build(mini_vocab_sources, out).returncode == 0
    agree(out, read_manifest(out))  # as built

    def restamp(file: Path, **stamp: str) -> None:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        save_file(load_file(file), str(file), metadata={k: v for k, v in header["__metadata__"].items()
                                                         if k.startswith("format")} | stamp)

    for damage, rel, needle in [
        (lambda d: shutil.copy2(d / "target/rank0.safetensors", d / "target/rank1.safetensors"),
         "target/rank1.safetensors", "holds rank 0's weights, not rank 1's (renamed or copied since the build"),
        (lambda d: restamp(d / "drafter/rank0.safetensors", **{"beamtrt.stage_key": "0" * 64, "beamtrt.rank": "0"}),
         "drafter/rank0.safetensors", "written by another build than manifest.json's (copied from one?)"),
    ]:
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(out, bad)
        damage(bad)
        with pytest.raises(CheckpointError, match=re.escape(f"{bad / rel}: {needle}")):
            agree(bad, read_manifest(bad))
    run = [sys.executable, str(ROOT / "runtime/run.py"), "--prompt", "hi", "--engine-dir", str(bad)]
    one_line_error(subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=ROOT),
                   f"{bad / rel}: written by another build", "rebuild")
    for r in range(2):  # the target's stage from a build before the stamps, the drafter's rebuilt since
        restamp(out / f"target/rank{r}.safetensors")
    agree(out, read_manifest(out))


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.__setitem__("precision", "fp8"), "precision bf16 differs from the manifest's precision fp8"),
    (lambda m: m.__setitem__("kv_cache", "fp8"), "kv_cache auto differs from the manifest's kv_cache fp8"),
    (lambda m: m["target"].__setitem__("dir", "drafter"), "differs from the manifest's target.architecture"),
    (lambda m: m["drafter"].__setitem__("train_block_size", "16"),  # it read "block_size 16 differs from ... 16"
     "block_size 16 differs from the manifest's drafter.train_block_size '16'"),
])
def test_validate_catches_a_manifest_that_contradicts_its_checkpoints(sources, tmp_path, edit, needle):
    from beamtrt.checkpoint.validate import validate

    out = _build_and_edit_manifest(sources, tmp_path / "out", edit)
    with pytest.raises(CheckpointError, match=needle):
        validate(out)


def test_a_drafter_precision_change_keeps_the_target(sources, tmp_path):
    """--drafter-precision bf16 -> fp8 (--force) calibrates again, for the drafter's ranges, but reuses the target:
    its files come from its own ranges alone (it was converted again, hours on Beam, into the same bytes); a
    --calib-samples change is named as the other flags are (it was "stage calibrate differs")."""
    fp8 = ("--precision", "fp8", "--calib-samples", "2")
    for out, flags in ((tmp_path / "fp8", fp8), (tmp_path / "bf16", ())):  # a target with scales, and one without
        assert build(sources, out, *flags).returncode == 0
        inode = (out / "target" / "rank0.safetensors").stat().st_ino
        forced = build(sources, out, *flags, "--drafter-precision", "fp8", "--calib-samples", "2", "--force")
        assert forced.returncode == 0, forced.stderr
        assert {k: v["status"] for k, v in read_manifest(out)["stages"].items()} == {
            "calibrate": "ran", "target": "reused", "drafter": "ran", "engines": "skipped"}, out
        assert (out / "target" / "rank0.safetensors").stat().st_ino == inode
    one_line_error(build(sources, tmp_path / "fp8", *fp8[:3], "3", "--drafter-precision", "fp8"),
                   "was built from other inputs or settings (--calib-samples 2 (now 3)); pass --force")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "other"}\n')
    one_line_error(build(sources, tmp_path / "fp8", *fp8, "--drafter-precision", "fp8", "--calib-prompts",
                         str(prompts)), "(stage calibrate differs: the target's or the drafter's files, or the "
                   "calibration prompts changed)")


def test_a_build_reads_each_input_once_and_keys_engines_on_the_gpu(sources, tmp_path, monkeypatch):
    """The stage keys hash the target's files for calibration and for the target (each read twice: a TB on Beam);
    and the engines' key holds the GPU the plugin library is built for (engines of another GPU were up to date)."""
    from beamtrt.build import engine, pipeline
    from beamtrt.checkpoint import manifest

    bc = BuildConfig(model=sources / "target", drafter=sources / "drafter", out=tmp_path / "out", precision="fp8",
                     tp=1, drafter_precision="fp8")
    read, digest = [], manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda path: read.append(path) or digest(path))
    keys = pipeline.Plan(bc).keys
    assert len(read) == len(set(read)) and sources / "target" / "config.json" in read

    monkeypatch.setattr(engine, "engine_support", lambda: None)  # a TensorRT-LLM host's answers
    monkeypatch.setattr(engine, "precision_unsupported", lambda *a: None)
    monkeypatch.setattr(engine, "unsupported", lambda cfg: None)  # (its dense first layer is not built yet)
    for arch in ("90a", "100a"):
        monkeypatch.setattr(engine, "cuda_archs", lambda arch=arch: arch)
        keys[arch] = pipeline.Plan(bc).keys
    assert keys["90a"]["engines"] != keys["100a"]["engines"] and keys["90a"]["target"] == keys["100a"]["target"]


def test_copied_tokenizer_files_get_the_modes_a_new_file_gets(sources, tmp_path):
    """The tokenizer files were copied with the source's mode: a 0600 one was unreadable to a Triton server running
    as another user, while the README promises the modes a plain mkdir gives."""
    from beamtrt.checkpoint.hf import _UMASK

    src = tmp_path / "src"
    shutil.copytree(sources, src)
    (src / "target" / "chat_template.jinja").write_text("{{ messages }}")
    (src / "target" / "chat_template.jinja").chmod(0o600)
    out = tmp_path / "out"
    proc = build(src, out)
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer" / "chat_template.jinja").stat().st_mode & 0o777 == 0o666 & ~_UMASK
