"""Tests for beamtrt.checkpoint.hf: sharded safetensors reading/writing and JSON helpers."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from beamtrt.checkpoint import hf
from beamtrt.checkpoint.hf import CheckpointReader, CheckpointWriter, read_json, save_state_dict, write_json
from beamtrt.errors import CheckpointError


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def six_tensors() -> dict[str, torch.Tensor]:
    """Six fp32 tensors of 400 bytes each."""
    return {f"layer.{i}.weight": torch.arange(100, dtype=torch.float32) + i for i in range(6)}


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    """A 3-shard checkpoint (two tensors per shard)."""
    save_state_dict(tmp_path / "ckpt", six_tensors(), max_shard_bytes=1000)
    return tmp_path / "ckpt"


def test_single_shard_round_trip_writes_no_index(tmp_path):
    tensors = {"b": torch.randn(3, 4), "a": torch.randint(-128, 128, (5,), dtype=torch.int8)}
    files = save_state_dict(tmp_path, tensors)
    assert files == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    reader = CheckpointReader(tmp_path)
    assert reader.names() == ["a", "b"]
    assert "a" in reader and "c" not in reader
    for name, t in tensors.items():
        assert torch.equal(reader.get(name), t)


def test_multi_shard_names_index_and_round_trip(sharded):
    shard_names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in sharded.iterdir()) == shard_names + ["model.safetensors.index.json"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 6 * 400
    expected_map = {f"layer.{i}.weight": shard_names[i // 2] for i in range(6)}
    assert index["weight_map"] == expected_map
    reader = CheckpointReader(sharded)
    assert reader.names() == sorted(expected_map)
    for name, t in six_tensors().items():
        assert torch.equal(reader.get(name), t)


def test_writer_context_manager_sets_files(tmp_path):
    with CheckpointWriter(tmp_path, max_shard_bytes=1000) as writer:
        for name, t in six_tensors().items():
            writer.add(name, t)
    assert len(writer.files) == 4 and writer.files[-1].name == "model.safetensors.index.json"
    assert all(p.exists() for p in writer.files)
    assert {p.stat().st_mode & 0o777 for p in writer.files} == {0o666 & ~hf._UMASK}  # not safetensors' 0600


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(7, 3).to(torch.bfloat16),
        torch.randn(7, 3),
        torch.randint(-128, 128, (7, 3), dtype=torch.int8),
        torch.randn(7, 3).to(torch.float8_e4m3fn),
    ],
    ids=["bf16", "fp32", "int8", "fp8"],
)
def test_dtype_round_trip_is_bit_exact(tmp_path, tensor):
    save_state_dict(tmp_path, {"t": tensor})
    reader = CheckpointReader(tmp_path)
    got = reader.get("t")
    assert got.dtype == tensor.dtype and reader.dtype("t") == tensor.dtype
    assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))


def test_get_casts_when_asked(tmp_path):
    save_state_dict(tmp_path, {"t": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)})
    got = CheckpointReader(tmp_path).get("t", dtype=torch.float32)
    assert got.dtype == torch.float32 and got.tolist() == [1.5, -2.0]


class NoDataHandle:
    """Wraps a shard handle so that reading tensor data fails."""

    def __init__(self, handle):
        self._handle = handle

    def keys(self):
        return self._handle.keys()

    def shape(self, name):
        return self._handle.shape(name)

    def dtype(self, name):
        return self._handle.dtype(name)

    def get_tensor(self, name):
        raise AssertionError(f"tensor data of {name} was read")


def test_shape_and_dtype_come_from_header(tmp_path, monkeypatch):
    save_state_dict(tmp_path, {"w": torch.zeros(4, 6, dtype=torch.bfloat16), "i": torch.zeros(3, dtype=torch.int64)})
    real_open = hf.SafetensorsFile
    monkeypatch.setattr(hf, "SafetensorsFile", lambda *a, **k: NoDataHandle(real_open(*a, **k)))
    reader = CheckpointReader(tmp_path)
    assert reader.shape("w") == (4, 6) and reader.dtype("w") == torch.bfloat16
    assert reader.shape("i") == (3,) and reader.dtype("i") == torch.int64
    reader.validate({"w": ((4, 6), torch.bfloat16), "i": ((3,), torch.int64)})
    with pytest.raises(AssertionError):  # proves the spy would catch a data read
        reader.get("w")


def test_get_streams_from_only_the_needed_shard(sharded, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("whole-file load used")

    monkeypatch.setattr(safetensors.torch, "load_file", forbidden)
    monkeypatch.setattr(safetensors.torch, "load", forbidden)
    opened: list[str] = []
    real_open = hf.SafetensorsFile

    def spy(path, **kwargs):
        opened.append(Path(path).name)
        return real_open(path, **kwargs)

    monkeypatch.setattr(hf, "SafetensorsFile", spy)
    reader = CheckpointReader(sharded)
    assert opened == []  # the index alone is enough to list names
    assert torch.equal(reader.get("layer.2.weight"), six_tensors()["layer.2.weight"])
    reader.get("layer.3.weight")  # same shard: handle is cached
    assert opened == ["model-00002-of-00003.safetensors"]


# --- bad input -------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    msg = one_line_error(CheckpointReader, tmp_path / "nope")
    assert "nope" in msg and "no such checkpoint directory" in msg


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    msg = one_line_error(CheckpointReader, tmp_path)
    assert str(tmp_path) in msg and "model.safetensors" in msg


def test_corrupt_index(sharded):
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    msg = one_line_error(CheckpointReader, sharded)
    assert "model.safetensors.index.json" in msg and "not valid JSON" in msg and "line 1" in msg


def test_index_without_weight_map(sharded):
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    msg = one_line_error(CheckpointReader, sharded)
    assert "model.safetensors.index.json" in msg and "weight_map" in msg


def test_index_pointing_at_missing_shard(sharded):
    (sharded / "model-00002-of-00003.safetensors").unlink()
    msg = one_line_error(CheckpointReader, sharded)
    assert "model-00002-of-00003.safetensors" in msg and "does not exist" in msg


def test_index_shard_outside_directory(sharded):
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../evil.safetensors"}}')
    assert "../evil.safetensors" in one_line_error(CheckpointReader, sharded)


def test_single_file_beside_an_index_is_ambiguous(sharded):
    """transformers would load model.safetensors and we the index: refused rather than read the other weights."""
    save_state_dict(sharded / "other", {"x": torch.ones(2)})
    (sharded / "other" / "model.safetensors").rename(sharded / "model.safetensors")
    msg = one_line_error(CheckpointReader, sharded)
    assert "both model.safetensors and model.safetensors.index.json" in msg and "stale" in msg


def test_garbage_single_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"this is not safetensors")
    msg = one_line_error(CheckpointReader, tmp_path)
    assert "model.safetensors" in msg and "not a valid safetensors file" in msg


def test_json_nested_too_deeply_is_one_line(tmp_path):
    """Python's JSON parser raises RecursionError at about a thousand levels (a 4 KB file): a traceback, from a
    config, an index, a manifest or a safetensors header."""
    deep = "[" * 2000 + "]" * 2000
    (tmp_path / "config.json").write_text(deep)
    assert one_line_error(read_json, tmp_path / "config.json", "model config") == \
        f"{tmp_path / 'config.json'}: model config is JSON nested too deeply"
    header = deep.encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    msg = one_line_error(CheckpointReader, tmp_path)
    assert "model.safetensors" in msg and "not a valid safetensors file" in msg and "not valid JSON" in msg


def _rewrite_header(path: Path, edit) -> None:
    """Apply `edit` to the parsed header of a safetensors file and write it back, the data unchanged."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


@pytest.mark.parametrize("field, value", [
    ("data_offsets", ["0", "400"]), ("data_offsets", [None, None]), ("data_offsets", [0.0, 400.0]),
    ("data_offsets", [False, 400]), ("dtype", ["F32"]), ("shape", ["100"]), ("shape", [100.0]), ("shape", [-100]),
])
def test_wrong_typed_header_field(tmp_path, field, value):
    save_state_dict(tmp_path, {"w": torch.zeros(100)})
    _rewrite_header(tmp_path / "model.safetensors", lambda h: h["w"].__setitem__(field, value))
    msg = one_line_error(CheckpointReader, tmp_path)
    assert "not a valid safetensors file" in msg and "'w'" in msg


@pytest.mark.parametrize("field, value", [("shape", [99]), ("shape", [10, 11]), ("data_offsets", [0, 396])])
def test_a_header_whose_shape_and_size_disagree_is_one_line(tmp_path, field, value):
    """Offsets that do not hold the shape's bytes (the check dropped, a reshape traceback came later)."""
    save_state_dict(tmp_path, {"w": torch.zeros(100)})
    _rewrite_header(tmp_path / "model.safetensors", lambda h: h["w"].__setitem__(field, value))
    assert "tensor 'w' has inconsistent data offsets" in one_line_error(CheckpointReader, tmp_path)


def test_metadata_not_an_object(tmp_path):
    save_state_dict(tmp_path, {"w": torch.zeros(100)})
    _rewrite_header(tmp_path / "model.safetensors", lambda h: h.__setitem__("__metadata__", ["pt"]))
    assert "__metadata__" in one_line_error(CheckpointReader, tmp_path)


def test_truncated_shard_is_reported_when_opened(sharded):
    shard = sharded / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    reader = CheckpointReader(sharded)
    reader.get("layer.0.weight")  # other shards still readable
    msg = one_line_error(reader.get, "layer.5.weight")
    assert "model-00003-of-00003.safetensors" in msg and "not a valid safetensors file" in msg
    assert "model-00003-of-00003.safetensors" in one_line_error(reader.shape, "layer.4.weight")


def test_index_lists_tensor_absent_from_shard(sharded):
    index_file = sharded / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    index_file.write_text(json.dumps(index))
    msg = one_line_error(CheckpointReader(sharded).get, "ghost")
    assert "'ghost'" in msg and "model-00001-of-00003.safetensors" in msg


def test_unknown_tensor(sharded):
    reader = CheckpointReader(sharded)
    for fn in (reader.get, reader.shape, reader.dtype):
        assert "'lm_head.weight'" in one_line_error(fn, "lm_head.weight")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_non_finite_values_are_rejected(tmp_path, bad, dtype):
    t = torch.tensor([1.0, bad, 2.0]).to(dtype)
    save_state_dict(tmp_path, {"model.norm.weight": t})
    reader = CheckpointReader(tmp_path)
    msg = one_line_error(reader.get, "model.norm.weight")
    assert "'model.norm.weight'" in msg and "model.safetensors" in msg
    assert ("1 NaN" if bad != bad else "1 Inf") in msg
    assert reader.get("model.norm.weight", check_finite=False).shape == (3,)


def test_fp8_e4m3_nan_is_rejected(tmp_path):
    save_state_dict(tmp_path, {"q": torch.tensor([0.5, float("nan")]).to(torch.float8_e4m3fn)})
    assert "'q'" in one_line_error(CheckpointReader(tmp_path).get, "q")


# --- validate ---------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path: Path) -> CheckpointReader:
    save_state_dict(
        tmp_path,
        {"model.norm.weight": torch.ones(5, dtype=torch.bfloat16), "ids": torch.zeros(2, dtype=torch.int8)},
    )
    return CheckpointReader(tmp_path)


def test_validate_accepts_matching_checkpoint(small):
    small.validate({"model.norm.weight": ((5,), torch.bfloat16), "ids": ((2,), torch.int8)})
    small.validate({"model.norm.weight": ((5,), None), "ids": ((2,), torch.int8)})


def test_validate_missing(small):
    expected = {"model.norm.weight": ((5,), None), "ids": ((2,), torch.int8)}
    expected |= {f"extra.{i}": ((1,), None) for i in range(7)}
    msg = one_line_error(small.validate, expected)
    assert "missing 7 tensor(s)" in msg and "'extra.0'" in msg and "... and 2 more" in msg
    assert "'extra.6'" not in msg
    small.validate(expected, allow_missing=["extra.*"])


def test_validate_unexpected(small):
    msg = one_line_error(small.validate, {"model.norm.weight": ((5,), None)})
    assert "1 unexpected tensor(s)" in msg and "'ids'" in msg
    small.validate({"model.norm.weight": ((5,), None)}, allow_unexpected=["ids"])


def test_validate_wrong_shape(small):
    msg = one_line_error(small.validate, {"model.norm.weight": ((576,), None), "ids": ((2,), torch.int8)})
    assert msg == f"{small.path / 'model.safetensors'}: tensor 'model.norm.weight' has shape (5,), expected (576,)"


def test_validate_wrong_dtype(small):
    msg = one_line_error(small.validate, {"model.norm.weight": ((5,), torch.float16), "ids": ((2,), torch.int8)})
    assert "'model.norm.weight'" in msg and "torch.bfloat16" in msg and "torch.float16" in msg
    msg = one_line_error(small.validate, {"model.norm.weight": ((5,), None), "ids": ((2,), None)})
    assert "'ids'" in msg and "floating-point" in msg


def test_validate_counts_further_mismatches(small):
    msg = one_line_error(small.validate, {"model.norm.weight": ((4,), None), "ids": ((3,), torch.int8)})
    assert "and 1 more mismatched" in msg


# --- writer -----------------------------------------------------------------------------------


def test_writer_removes_shards_on_exception(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointWriter(tmp_path, max_shard_bytes=1000) as writer:
            for name, t in six_tensors().items():
                writer.add(name, t)
            assert list(tmp_path.glob("*.safetensors"))  # shards were flushed before the failure
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_existing_checkpoint(sharded):
    msg = one_line_error(CheckpointWriter, sharded)
    assert str(sharded) in msg and "overwrite" in msg
    save_state_dict(sharded, {"x": torch.ones(2)}, overwrite=True)
    assert sorted(p.name for p in sharded.iterdir()) == ["model.safetensors"]
    assert CheckpointReader(sharded).names() == ["x"]


def test_writer_refuses_lone_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    assert "model.safetensors.index.json" in one_line_error(CheckpointWriter, tmp_path)


def test_writer_rejects_duplicate_names(tmp_path):
    writer = CheckpointWriter(tmp_path)
    writer.add("a", torch.ones(1))
    assert "'a'" in one_line_error(writer.add, "a", torch.zeros(1))


def test_writer_rejects_empty_checkpoint(tmp_path):
    one_line_error(save_state_dict, tmp_path, {})
    assert list(tmp_path.glob("*.safetensors")) == []


def test_writer_handles_views_and_tied_weights(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = [("emb", base), ("lm_head", base), ("col", base[:, 1]), ("t", base.t())]
    save_state_dict(tmp_path, iter(tensors))
    reader = CheckpointReader(tmp_path)
    for name, t in tensors:
        assert torch.equal(reader.get(name), t)


def test_writer_keeps_shards_within_limit(tmp_path):
    tensors = {f"w{i}": torch.zeros(100) for i in range(10)}  # 400 bytes each
    save_state_dict(tmp_path, tensors, max_shard_bytes=1300)
    weight_map = read_json(tmp_path / "model.safetensors.index.json", "index")["weight_map"]
    per_shard: dict[str, int] = {}
    for shard in weight_map.values():
        per_shard[shard] = per_shard.get(shard, 0) + 400
    assert len(per_shard) == 4 and max(per_shard.values()) <= 1300


# --- JSON helpers -----------------------------------------------------------------------------


def test_json_round_trip_is_atomic_and_ordered(tmp_path):
    path = tmp_path / "config.json"
    write_json(path, {"z": 1, "a": [1, 2]})
    text = path.read_text()
    assert text.endswith("}\n") and text.index('"z"') < text.index('"a"') and '\n  "z": 1' in text
    assert read_json(path, "config") == {"z": 1, "a": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_read_json_errors(tmp_path):
    path = tmp_path / "config.json"
    assert one_line_error(read_json, path, "model config") == f"{path}: missing model config"
    assert one_line_error(read_json, path, "config.json") == f"{tmp_path}: no config.json"  # not named twice
    path.write_text('{\n  "a": 1,\n}')
    msg = one_line_error(read_json, path, "model config")
    assert msg.startswith(f"{path}: model config is not valid JSON (") and "(line 3: " in msg
    path.write_text("[1, 2]")
    assert "JSON object" in one_line_error(read_json, path, "model config")


def test_a_mount_point_output_is_refused_before_the_work(tmp_path, monkeypatch):
    """An output replaced whole is written beside it and renamed into place, which a mount point (a container's
    volume: --out /engines) cannot be: a build ran to its end, then failed on the rename (EBUSY) and kept nothing.
    Refused at the command's start and at staging; a folder written into (train_drafter's --work) may be one."""
    from beamtrt.cli_util import output_path
    from beamtrt.errors import BeamtrtError

    mnt, link = tmp_path / "mnt", tmp_path / "link"
    mnt.mkdir()
    link.symlink_to(mnt)  # written through: its target is what would be replaced
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == os.fspath(mnt) or real(p))
    for out in (mnt, link):
        with pytest.raises(BeamtrtError, match=f"^--out {out}: a mount point, .* write to a folder inside it$"):
            output_path(out, "--out", directory=True)
        with pytest.raises(CheckpointError, match=f"^{mnt}: a mount point"), hf.staging(out):
            pytest.fail("staged")
    assert output_path(mnt, "--work", directory=True, replaced=False) == mnt
    assert output_path(mnt / "nvfp4-tp4", "--out", directory=True) == mnt / "nvfp4-tp4"  # inside it: fine
    assert [p.name for p in mnt.iterdir()] == []


def test_a_device_as_an_output_directory_is_named_as_one():
    from beamtrt.cli_util import output_path
    from beamtrt.errors import BeamtrtError

    with pytest.raises(BeamtrtError, match="^--out /dev/null: is a device, a pipe or a socket; expected a directory"):
        output_path("/dev/null", "--out", directory=True)  # it said "is a file"


def test_replace_dir_swaps_what_is_there_and_puts_it_back_on_failure(tmp_path, monkeypatch):
    import os

    for name in ("file", "dir"):
        out = tmp_path / name
        out.write_text("old") if name == "file" else out.mkdir()
        with hf.staging(out) as tmp:
            assert tmp.stat().st_mode & 0o777 == 0o777 & ~hf._UMASK  # not mkdtemp's 0700
            (tmp / "new").write_text("new")
            hf.replace_dir(tmp, out)
        assert (out / "new").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]

    real = os.replace

    def full_disk(src, dst):  # moving the old output aside (and back) works; moving the new one in fails
        if ".tmp-" in str(src):
            raise OSError(28, "No space left on device")
        real(src, dst)

    def signal_after(n):  # Ctrl-C just after the n-th move (Python raises it once the call returns): 1 locks the
                          # folder aside, 2 moves the old output into it, 3 the new one in
        moves = []

        def replace(src, dst):
            real(src, dst)
            moves.append(dst)
            if len(moves) == n:
                raise KeyboardInterrupt
        return replace
    for broken, error, now in ((full_disk, OSError, "new"), (signal_after(1), KeyboardInterrupt, "new"),
                               (signal_after(2), KeyboardInterrupt, "new"),
                               (signal_after(3), KeyboardInterrupt, "newer")):
        with pytest.raises(error), hf.staging(tmp_path / "dir") as tmp:
            (tmp / "new").write_text("newer")
            monkeypatch.setattr(hf.os, "replace", broken)  # in replace_dir only
            hf.replace_dir(tmp, tmp_path / "dir")
        monkeypatch.undo()
        assert (tmp_path / "dir" / "new").read_text() == now  # the previous output back, or the new one in place
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]  # nothing aside, no staging left


def test_an_output_moved_aside_by_a_killed_run_is_put_back(tmp_path, capsys):
    """Killed between replace_dir's two moves: no output at `out`, the old one aside; the next writer puts it back."""
    aside = tmp_path / ".out.old-killed"
    (aside / "x").mkdir(parents=True)
    (aside / "x" / "f").write_text("old")
    with hf.staging(tmp_path / "out"):
        assert (tmp_path / "out" / "f").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert f"note: put back {tmp_path / 'out'} from {aside}" in capsys.readouterr().err


def test_a_signal_while_the_replaced_output_is_deleted_leaves_it_to_the_next_writer(tmp_path, monkeypatch, capsys):
    """Ctrl-C while a build deleted the output it had replaced left .out.old-* for good (hundreds of GB for Beam):
    no later run removed it. It is locked while it is deleted, and the next writer removes what is left."""
    import fcntl
    import os
    import shutil

    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    real = shutil.rmtree

    def interrupted(path, *args, **kwargs):
        if ".old-" in str(path):
            (Path(path) / "x" / "old").unlink()  # partly deleted
            raise KeyboardInterrupt
        real(path, *args, **kwargs)
    monkeypatch.setattr(hf.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt), hf.staging(out) as tmp:
        (tmp / "new").write_text("new")
        hf.replace_dir(tmp, out)
    monkeypatch.undo()
    [aside] = tmp_path.glob(".out.old-*")
    assert (out / "new").read_text() == "new" and (aside / "x").is_dir()
    assert f"note: {out} is in place; what is left of the output it replaced, {aside}, is removed by the next run" \
        in capsys.readouterr().err
    fd = os.open(aside, os.O_RDONLY)  # held: another process still deleting it
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(CheckpointError, match="another running process is replacing it"), hf.staging(out):
        pass
    os.close(fd)
    with hf.staging(out):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert f"note: removed {aside} (" in capsys.readouterr().err


def test_a_leftovers_size_counts_only_what_removing_it_frees(tmp_path, capsys):
    """A killed build's folder shares the files of the stages it reused with the output (hard links): removing it
    frees only its own, and the note said the sum of both."""
    import os

    out, left = tmp_path / "out", tmp_path / ".out.tmp-killed"
    out.mkdir()
    left.mkdir()
    (out / "reused").write_bytes(os.urandom(3_000_000))  # not zeros: a compressing file system would store none
    os.link(out / "reused", left / "reused")
    (left / "own").write_bytes(os.urandom(1_000_000))
    with hf.staging(out):
        pass
    assert not left.exists() and (out / "reused").is_file()
    assert f"note: removed {left} (1.0 MB), the unfinished output of an earlier run" in capsys.readouterr().err


def test_staging_an_output_the_caller_found_absent_refuses_one_written_since(tmp_path):
    """A writer that checked its output was absent (or an empty folder) and may not replace one: another process's
    output that appeared before its staging lock was held is one line, and is left as it is."""
    out = tmp_path / "out"
    out.mkdir()
    with hf.staging(out, "pass --force") as tmp:  # an empty folder is no output
        (tmp / "mine").write_text("x")
        hf.replace_dir(tmp, out)
    assert (out / "mine").is_file()
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(out))}: written by another process while this one "
                                              "ran; pass --force$"), hf.staging(out, "pass --force"):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "mine").is_file()
    with hf.staging(out) as tmp:  # a writer that may replace it
        hf.replace_dir(tmp, out)
    assert not (out / "mine").exists()
    out.rmdir()  # what an interrupted replace leaves: the old output aside, none in its place
    (tmp_path / ".out.old-1" / "x").mkdir(parents=True)
    (tmp_path / ".out.old-1" / "x" / "f").write_text("old")
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(out))}: put back as above; pass --force$"), \
            hf.staging(out, "pass --force"):  # was 'written by another process', after the note that put it back
        pass
    assert out.is_dir() and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_staging_removes_the_folders_it_made_when_no_output_came(tmp_path):
    """export_triton.py --out a/b/repo that failed left a/b/ behind."""
    (tmp_path / "a").mkdir()
    with pytest.raises(CheckpointError, match="^failed$"), hf.staging(tmp_path / "a" / "b" / "c" / "out"):
        raise CheckpointError("failed")
    assert list(tmp_path.iterdir()) == [tmp_path / "a"] and not list((tmp_path / "a").iterdir())  # a was there
    with hf.staging(tmp_path / "a" / "b" / "out") as tmp:
        (tmp / "f").write_text("x")
        hf.replace_dir(tmp, tmp_path / "a" / "b" / "out")
    assert (tmp_path / "a" / "b" / "out" / "f").read_text() == "x"


def test_staging_removes_what_killed_writers_left_and_refuses_beside_a_running_one(tmp_path, capsys):
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "engines"
    writer = ("import sys, time\nfrom pathlib import Path\nfrom beamtrt.checkpoint import hf\n"
              "with hf.staging(Path(sys.argv[1])) as tmp:\n"
              "    (tmp / 'rank0.safetensors').write_bytes(bytes(1000))\n    print(tmp, flush=True)\n"
              "    time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(hf.__file__).parents[2])}

    def start():
        return subprocess.Popen([sys.executable, "-c", writer, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    procs = [start()]
    try:
        killed = Path(procs[0].stdout.readline().strip())
        procs[0].send_signal(signal.SIGKILL)  # nothing runs to remove its folder (kill -9, the OOM killer)
        procs[0].wait()
        assert killed.is_dir() and killed.name.startswith(".engines.tmp-")
        old = tmp_path / ".engines.tmp-before"  # one from a version that held no lock
        old.mkdir()
        other = tmp_path / ".engines2.tmp-x"  # another output's
        other.mkdir()
        procs.append(start())
        running = Path(procs[1].stdout.readline().strip())
        assert not killed.exists() and not old.exists() and other.is_dir()
        with pytest.raises(CheckpointError) as err, hf.staging(out):
            pass
        assert str(err.value) == (f"{out}: another running process is writing it (into {running}); let it finish, "
                                  "or choose another output")
        assert running.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [running.name, other.name])  # its own staging is gone again
        procs[1].kill()
        procs[1].wait()
        with hf.staging(out) as tmp:
            assert not running.exists() and other.is_dir()
            assert tmp.name.startswith(".engines.tmp-") and tmp.is_dir()
        assert not tmp.exists()
        notes = capsys.readouterr().err.splitlines()
        assert notes == [f"note: removed {running} (0.0 MB), the unfinished output of an earlier run that was killed"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_write_json_writes_through_a_link_and_refuses_a_device(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("{}")
    (tmp_path / "link.json").symlink_to(target)
    write_json(tmp_path / "link.json", {"a": 1})
    assert (tmp_path / "link.json").is_symlink() and json.loads(target.read_text()) == {"a": 1}
    with pytest.raises(CheckpointError, match="not a regular file"):
        write_json(Path("/dev/null"), {"a": 1})
    assert Path("/dev/null").is_char_device()
    (tmp_path / "was-a-folder").write_text("")  # put there since the command checked its --json: 'File exists'
    for path in (tmp_path / "was-a-folder" / "out.json", tmp_path / "was-a-folder" / "sub" / "out.json"):
        with pytest.raises(CheckpointError, match=f"^{path}: {tmp_path / 'was-a-folder'} is a file, not a directory$"):
            write_json(path, {"a": 1})


def test_writing_holds_a_folder_against_other_processes(tmp_path, capsys):
    import threading
    import time

    from conftest import written_by_another_process

    folder = tmp_path / "cache"
    with written_by_another_process(folder) as other:
        with pytest.raises(CheckpointError, match="^busy$"), hf.writing(folder, busy="busy"):
            pass  # not reached: refused at once
        start = time.monotonic()
        threading.Timer(1.0, other.kill).start()  # the other run ends in a second
        with hf.writing(folder):  # waits for it (its lock goes with it, a moment before it can be reaped)
            assert time.monotonic() - start >= 0.9
            other.wait(timeout=60)
            with hf.writing(folder, busy="busy"):  # this process holds it already
                (folder / "shard").write_text("x")
    assert capsys.readouterr().err == f"note: waiting for another process to finish writing {folder}\n"
    assert (folder / "shard").is_file()
    with hf.writing(tmp_path / "new"):
        pass
    assert not (tmp_path / "new").exists()  # made for the block and left empty: removed
    (tmp_path / "link").symlink_to(tmp_path / "target")  # train_drafter.py --work LINK: it was 'File exists'
    with hf.writing(tmp_path / "link"):
        (tmp_path / "link" / "state").write_text("x")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "state").is_file()


def test_staging_a_relative_output_is_not_refused_for_its_own_folder(tmp_path, monkeypatch):
    """Python 3.12's mkdtemp returns an absolute path for a relative dir: the writer's own folder, globbed relative,
    must still be told apart by its name, or every relative --out was 'written by another running process'."""
    import os
    import tempfile

    monkeypatch.chdir(tmp_path)
    real = tempfile.mkdtemp
    monkeypatch.setattr(hf.tempfile, "mkdtemp", lambda *a, **k: os.path.abspath(real(*a, **k)))  # as 3.12+ does
    with hf.staging(Path("out")) as tmp:
        (tmp / "x").write_text("1")
        hf.replace_dir(tmp, Path("out"))
    assert (tmp_path / "out" / "x").read_text() == "1"


def test_streaming_writer_writes_on_after_a_partial_write(tmp_path, monkeypatch):
    """One pwrite moves at most ~2 GiB on Linux (0x7ffff000 bytes): a larger tensor was a 'short write' error. Here
    pwrite writes at most 1,000 bytes a call; the file is still whole, and so is what reads of 1,000 bytes at most
    give back (preadv has the same limit). A write the OS refuses is one line."""
    import os

    from beamtrt.checkpoint.stream import StreamingSafetensors

    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: pwrite(fd, data[:1000], offset))
    w = torch.randn(70, 50)
    f = StreamingSafetensors(tmp_path / "a.safetensors", {"w": (tuple(w.shape), w.dtype)})
    f.write("w", w)
    f.close()
    assert torch.equal(safetensors.torch.load_file(tmp_path / "a.safetensors")["w"], w)

    from beamtrt.checkpoint.stream import SafetensorsFile  # and reads on after a short read, where preadv stops

    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: preadv(fd, [views[0][:1000]], offset))
    assert torch.equal(SafetensorsFile(tmp_path / "a.safetensors").get_tensor("w"), w)
    monkeypatch.setattr(os, "preadv", preadv)

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "pwrite", full)
    f = StreamingSafetensors(tmp_path / "b.safetensors", {"w": (tuple(w.shape), w.dtype)})
    with pytest.raises(CheckpointError, match=r"b.safetensors: cannot write 'w' \(No space left on device\)$"):
        f.write("w", w)
    f.abort()
    assert not (tmp_path / "b.safetensors").exists()


def test_streaming_writer_counts_rows_not_bytes(tmp_path):
    """A row written twice made up, in the byte count, for a row never written, and a row past the tensor's end went
    into the next tensor: close() passed both files (a quantization review's cases)."""
    from beamtrt.checkpoint.stream import StreamingSafetensors

    specs = {"a": ((2, 4), torch.float32), "b": ((4,), torch.float32)}
    f = StreamingSafetensors(tmp_path / "a.safetensors", specs)
    f.write("a", torch.ones(4), 0)
    with pytest.raises(CheckpointError, match=r"internal error: a\[0\] written twice$"):
        f.write("a", torch.ones(4), 0)
    with pytest.raises(CheckpointError, match=r"internal error: a\[2\] is outside its \(2, 4\)$"):
        f.write("a", torch.ones(4), 2)
    f.write("b", torch.ones(4))
    with pytest.raises(CheckpointError, match=r"internal error: b written twice$"):
        f.write("b", torch.ones(4))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) not fully written, first 'a'$"):
        f.close()
    f = StreamingSafetensors(tmp_path / "b.safetensors", specs)
    for row in (1, 0):
        f.write("a", torch.full((4,), float(row)), row)
    f.write("b", torch.ones(4))
    f.close()
    rows = safetensors.torch.load_file(tmp_path / "b.safetensors")["a"]
    assert torch.equal(rows, torch.tensor([[0.0] * 4, [1.0] * 4]))


def test_a_refused_safetensors_write_is_one_line(tmp_path):
    """safetensors reports a write the OS refuses as its own SafetensorError, not an OSError: a full disk (or, here, a
    folder that is a file) was a traceback."""
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"file/w.safetensors: cannot write it \(.*Not a directory"):
        hf.save_safetensors({"w": torch.zeros(4)}, tmp_path / "file" / "w.safetensors")


def test_an_error_inside_staging_names_the_output_not_the_staging_folder(tmp_path):
    """A full disk named the hidden staging folder ('.bm.tmp-utwk71y8/model-00002.partial.safetensors'), which is gone
    by the time the error is shown: names under it become names under the output the user gave."""
    from beamtrt.cli_util import error_line

    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as err, hf.staging(out) as tmp:
        raise CheckpointError(f"{tmp / 'target' / 'rank0.safetensors'}: cannot write it (No space left on device)")
    assert str(err.value) == f"{out / 'target' / 'rank0.safetensors'}: cannot write it (No space left on device)"
    with pytest.raises(OSError) as err, hf.staging(out) as tmp:
        (tmp / "file").write_text("")
        (tmp / "file" / "x").write_text("")
    assert error_line(err.value) == f"{out / 'file' / 'x'}: Not a directory"
    with pytest.raises(shutil.Error) as err, hf.staging(out) as tmp:  # copytree's list of (src, dst, why)
        raise shutil.Error([("/a/rank0", str(tmp / "e" / "rank0"), f"[Errno 28] No space: '{tmp / 'e' / 'rank0'}'")])
    assert error_line(err.value) == f"copying /a/rank0: [Errno 28] No space: '{out / 'e' / 'rank0'}'"
    assert list(tmp_path.iterdir()) == []


def test_a_feature_shard_that_cannot_be_written_is_named_once(tmp_path):
    """It was '.../features-00000.safetensors: cannot write it (.../features-00000.safetensors.tmp: cannot write it
    (...)); the cache's directory must be writable'."""
    from beamtrt.errors import BeamtrtError
    from beamtrt.train.features import _save

    (tmp_path / "file").write_text("")
    shard = tmp_path / "file" / "features-00000.safetensors"
    with pytest.raises(BeamtrtError) as err:
        _save({"ids": torch.zeros(4)}, shard)
    assert str(err.value).startswith(f"{shard}: cannot write it (") and ".tmp" not in str(err.value), err.value


def test_a_loop_of_symbolic_links_is_one_line(tmp_path, monkeypatch):
    """Path.resolve raises RuntimeError on a loop in Python 3.10-3.12 (a traceback from every command that compares
    paths) and returns the path as it is in 3.13; both are the same one-line error."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for resolve in (Path.resolve, lambda self, strict=False: self.absolute()):  # 3.10-3.12, then 3.13
        monkeypatch.setattr(Path, "resolve", resolve)
        with pytest.raises(CheckpointError, match=f"^{tmp_path / 'a'}: a loop of symbolic links$"):
            hf.holds(tmp_path, tmp_path / "a")
        assert hf.resolved(tmp_path / "not-made-yet") == tmp_path / "not-made-yet"


def test_an_output_that_is_a_symbolic_link_is_written_through(tmp_path):
    """The link was replaced by a directory and its target kept the old output; a dangling one became a directory.
    Now the target is replaced, or made, and the link stays (as write_text does for files)."""
    real = tmp_path / "v1"
    real.mkdir()
    (real / "old").write_text("")
    for link, target in ((tmp_path / "live", real), (tmp_path / "next", tmp_path / "v2" / "x")):
        link.symlink_to(target)
        with hf.staging(link) as tmp:
            (tmp / "new").write_text("")
            hf.replace_dir(tmp, link)
        assert link.is_symlink() and sorted(p.name for p in target.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live", "next", "v1", "v2"]
