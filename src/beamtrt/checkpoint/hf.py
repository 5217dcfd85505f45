"""Streaming reader and sharded writer for Hugging Face safetensors checkpoints, plus JSON file helpers."""

from __future__ import annotations

import errno
import fcntl
import fnmatch
import glob
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from beamtrt.checkpoint.stream import DTYPES, SafetensorsError, SafetensorsFile
from beamtrt.cli_util import error_line
from beamtrt.config import BeamConfig, DrafterConfig
from beamtrt.errors import BeamtrtError, CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import: os.umask can only be read by setting it


@contextmanager
def staging(final: Path, absent: str | None = None) -> Iterator[Path]:
    """A hidden temporary directory beside `final` to write an output into, then rename into place (`replace_dir`);
    whatever is left of it when the block ends is removed. It has the mode a plain mkdir gives (mkdtemp's 0700
    would hide the output from other users, such as a tritonserver's), and this process holds a lock on it while
    the block runs, so that leftovers of killed writers (kill -9, the out-of-memory killer: nothing ran to remove
    them) are told apart from a running writer's: they are removed, while a running writer of the same output is
    one line (two writers would each replace the other's output, or fail on it). A symbolic link is written
    through: its target is staged beside and replaced, and the link stays. Folders made to hold it are removed
    again when no output came of the block. `absent`: the caller found no output (or an empty folder) there and
    may not replace one: if another process wrote one since, that is one line ending with this remedy."""
    final = followed(Path(final))
    if is_mount(final):  # found only at the end, after the work, by the rename (EBUSY)
        raise CheckpointError(f"{final}: {MOUNT_POINT}")
    made = [p for p in (final.parent, *final.parent.parents) if not p.exists()]  # the deepest first
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp, fd = _locked_dir(final, "tmp")
    except OSError as e:  # the error would name the temporary folder, which the user never gave
        _remove_empty(made)
        raise CheckpointError(f"{final}: cannot write in {final.parent} ({e.strerror or e})") from None
    try:
        tmp.chmod(0o777 & ~_UMASK)
        # after its own is in place: of two writers starting at once, one sees the other (or each the other: both stop)
        put_back = _remove_leftovers(final, tmp)
        if absent is not None and (final.is_symlink() or final.exists()) and not (
                final.is_dir() and not any(final.iterdir())):  # once this lock is held, no writer of it runs
            why = "put back as above" if put_back else "written by another process while this one ran"
            raise CheckpointError(f"{final}: {why}; {absent}")
        yield tmp
    except (BeamtrtError, OSError) as e:  # a file that cannot be written is named where the user will look for it
        _rename_in_error(e, tmp, final)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)
        if not final.exists():
            _remove_empty(made)


def _locked_dir(final: Path, kind: str) -> tuple[Path, int]:
    """A new hidden folder `.<final's name>.<kind>-*` beside `final`, and an open descriptor holding its lock. It is
    made under another prefix and locked before it takes that name, so `_remove_leftovers` never finds it unheld."""
    new = Path(tempfile.mkdtemp(prefix=f".{final.name}.new-", dir=final.parent))
    try:
        fd = os.open(new, os.O_RDONLY)
    except BaseException:
        new.rmdir()
        raise
    path = new.with_name(new.name.replace(".new-", f".{kind}-", 1))
    try:
        _lock(fd)
        os.replace(new, path)
    except BaseException:  # a failed rename, or a signal just after it
        for folder in (new, path):
            shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)
        raise
    return path, fd


def _remove_empty(folders: list[Path]) -> None:
    """Remove `folders` (each inside the next) while they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _rename_in_error(e: BaseException, tmp: Path, final: Path) -> None:
    """Names under the staging folder `tmp` in an error's message (or an OSError's file names) become names under
    `final`, the output the user gave: the staging folder is gone once the error is shown."""
    def renamed(text):
        return text.replace(str(tmp), str(final)) if isinstance(text, str) else text

    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list):  # copytree's [(src, dst, why), ...]
        e.args = ([tuple(map(renamed, failed)) for failed in e.args[0]], *e.args[1:])
    elif isinstance(e, OSError):
        e.filename, e.filename2 = renamed(e.filename), renamed(e.filename2)
    elif e.args:
        e.args = (renamed(e.args[0]), *e.args[1:])


def _lock(fd: int) -> bool | None:
    """Takes an exclusive lock on an open directory without waiting: True, False if another process holds one, None
    on a file system without locks (which nothing may then be removed or refused on)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None


def recover_output(final: Path) -> bool:
    """What `staging` does first, for an output read before it is written (train_drafter.py's --init X --out X): an
    old output a run stopped while replacing it left aside is put back (True if one was), killed writers' leftovers
    removed."""
    return _remove_leftovers(followed(Path(final)))


def _remove_leftovers(final: Path, mine: Path | None = None) -> bool:
    """Removes the `staging` directories for `final` (.tmp-*) and the old outputs `replace_dir` moved aside (.old-*)
    that no running process holds (a killed or interrupted writer's) but `mine`; one that a running process holds is
    one line. An old output whose replacement never came (`final` missing) is put back instead: True if one was."""
    put_back = False
    name, mine_name = glob.escape(final.name), mine and mine.name  # a name: mkdtemp's path is absolute (3.12)
    for old in sorted([*final.parent.glob(f".{name}.tmp-*"), *final.parent.glob(f".{name}.old-*")]):
        if old.name == mine_name or old.is_symlink() or not old.is_dir():
            continue
        try:
            fd = os.open(old, os.O_RDONLY)
        except OSError:
            continue
        try:
            held = _lock(fd)
            aside = ".old-" in old.name
            if held is False:
                raise CheckpointError(f"{final}: another running process is {'replacing' if aside else 'writing'} it "
                                      f"(into {old}); let it finish, or choose another output")
            if held is None:  # a file system without locks: nothing is known of it
                continue
            if aside and (old / "x").exists() and not (final.exists() or final.is_symlink()):
                os.replace(old / "x", final)
                old.rmdir()
                print(f"note: put back {final} from {old}, where an earlier run that was stopped while replacing it "
                      "left it", file=sys.stderr, flush=True)
                put_back = True
                continue
            # the disk space it held: not the files it shares by hard links (a reused stage's, with the output)
            size = sum(st.st_blocks * 512 for st in (f.lstat() for f in old.rglob("*")) if st.st_nlink == 1)
            shutil.rmtree(old, ignore_errors=True)
            what = ("the replaced output an earlier run was stopped while deleting" if aside else
                    "the unfinished output of an earlier run that was killed")
            print(f"note: removed {old} ({size / 1e6:.1f} MB), {what}", file=sys.stderr, flush=True)
        finally:
            os.close(fd)
    return put_back


_WRITING: set[Path] = set()  # folders this process holds through `writing`


@contextmanager
def writing(folder: Path, busy: str | None = None) -> Iterator[None]:
    """Holds `folder` (made if missing, removed again if left empty) for writing while the block runs: another process
    asking for it waits until this one is done, saying so, or, given `busy` (the line to say), fails at once.
    Re-entrant within a process; on a file system without locks nothing is held. A symbolic link is followed (its
    target is made if missing)."""
    folder = followed(Path(folder))
    key = folder.resolve()
    if key in _WRITING:
        yield
        return
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        if _lock(fd) is False:
            if busy is not None:
                raise CheckpointError(busy)
            print(f"note: waiting for another process to finish writing {folder}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        _WRITING.add(key)
        try:
            yield
        finally:
            _WRITING.discard(key)
    finally:
        os.close(fd)
        if made:
            try:
                folder.rmdir()  # only if nothing was written
            except OSError:
                pass


def holds(outer: Path, inner: Path) -> bool:
    """Whether `outer` is `inner` or one of its ancestors (links resolved): replacing `outer` would replace `inner`."""
    outer, inner = resolved(outer), resolved(inner)
    return outer == inner or outer in inner.parents


def resolved(path: str | Path) -> Path:
    """Path.resolve(), with a loop of symbolic links a one-line CheckpointError (Python 3.10-3.12 raise RuntimeError
    there, 3.13 returns the path as it is)."""
    try:
        real = Path(path).resolve()
        os.stat(path)
    except RuntimeError:
        raise CheckpointError(f"{path}: a loop of symbolic links") from None
    except OSError as e:  # a path not made yet is fine
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path}: a loop of symbolic links") from None
    return real


def holds_cwd(path: Path) -> bool:
    """Whether `path` is the working directory or one of its ancestors (an output that cannot be renamed away)."""
    return holds(path, Path.cwd())


MOUNT_POINT = ("a mount point, which an output written beside it and renamed into place cannot replace: write to a "
               "folder inside it")


def is_mount(path: Path) -> bool:
    """Whether an output at `path` would replace a mount point (a container's volume, say): rename(2) cannot."""
    return os.path.ismount(followed(Path(path)))


def followed(path: Path) -> Path:
    """Where an output at `path` goes: a symbolic link's target (even one not made yet), else `path`."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def replace_dir(tmp: Path, out: Path) -> None:
    """Move a finished temp_dir to `out`. Whatever is at `out` (a directory or a file) is moved aside first and
    deleted only once the new one is in place; if the move fails, it is put back. The folder aside is locked while
    this runs: if a signal stops its deletion (a large output takes a while), or the process is killed between the
    moves, the next `staging` of `out` removes what is left of it (or puts it back where no new output came)."""
    tmp, out = Path(tmp), followed(Path(out))
    if holds_cwd(out):
        raise CheckpointError(f"{out}: cannot replace the current directory or one holding it; choose another output")
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        return
    aside, fd = _locked_dir(out, "old")
    moved = False  # whether the new output is in place
    try:
        try:
            os.replace(out, aside / "x")
            os.replace(tmp, out)
        except BaseException:  # a failed move, or a signal just after one: undo what moved
            moved = not tmp.exists()
            if not moved and (aside / "x").exists() and not (out.exists() or out.is_symlink()):
                os.replace(aside / "x", out)  # the old output back
            raise
        moved = True
    finally:
        try:
            if moved or not (aside / "x").exists():  # never the only copy of the old output
                shutil.rmtree(aside, ignore_errors=True)
        except BaseException:  # a signal while deleting: the new output is in place, the old one partly deleted
            print(f"note: {out} is in place; what is left of the output it replaced, {aside}, is removed by the "
                  "next run that writes it", file=sys.stderr, flush=True)
            raise
        finally:
            os.close(fd)


def require_dir(path: str | Path, expected: str, flag: str = "") -> Path:
    """`path` if it is a directory, else one line saying what it is instead (missing, or a file) and what was
    `expected` there; `flag` names the option that gave it."""
    path = Path(path)
    if not path.is_dir():
        found = "no such directory" if not path.exists() else "is a file" if path.is_file() else "not a directory"
        raise CheckpointError(f"{flag + ' ' if flag else ''}{path}: {found}; expected {expected}")
    return path


def read_json(path: Path, what: str) -> dict:
    """Load a JSON object from `path`; `what` names the file's role in error messages."""
    path = Path(path)
    if not path.is_file():
        require_dir(path.parent, f"a directory holding {what}")  # a checkpoint path that is missing, or a file
        if path.is_dir():
            raise CheckpointError(f"{path}: a directory, not {what}")
        raise CheckpointError(f"{path.parent}: no {what}" if what == path.name else f"{path}: missing {what}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: {what} is not valid JSON (line {err.lineno}: {err.msg})") from None
    except RecursionError:  # a damaged or hostile file: Python's parser gives up at about a thousand levels
        raise CheckpointError(f"{path}: {what} is JSON nested too deeply") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: {what} is not valid JSON (not UTF-8 text)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read {what} ({err.strerror})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {type(obj).__name__}")
    return obj


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None,
                     name: str | Path | None = None) -> None:
    """safetensors' save_file, with the mode open() would give (it creates its files 0600: unreadable to a
    tritonserver running as another user); a write the OS refuses (a full disk) is one line naming the file as
    `name` (default: `path`; a temporary file's final name)."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:  # not an OSError: 'Error while serializing: I/O error: No space left on device (os
        why = re.search(r"I/O error: (.+?) \(os error \d+\)", str(e))  # error 28) at path "<its temporary file>"'
        raise CheckpointError(f"{name or path}: cannot write it ({why[1] if why else error_line(e)})") from None
    os.chmod(path, 0o666 & ~_UMASK)


def write_json(path: str | Path, obj: dict) -> None:
    """Write `obj` as indented JSON with `write_text`: every config, manifest, --json and summary file."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n", "JSON")


def make_parent(path: Path) -> None:
    """The folder `path` goes into, made with its missing parents; one of them that is a file (put there since the
    command checked its output) is one line, not mkdir's 'File exists'."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        from beamtrt.cli_util import existing

        raise CheckpointError(f"{path}: {existing(path.parent)} is a file, not a directory") from None


def write_text(path: str | Path, text: str, what: str = "a file") -> None:
    """Write `text` atomically (temp file in the same directory, then os.replace), making missing folders; `what` is
    what the file holds, for the one line refusing a path that is not a regular file."""
    path = followed(Path(path))  # a link's target is written, not the link
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path}: not a regular file; cannot write {what} there")
    make_parent(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp's 0600 -> what open() would give (as save_safetensors does)
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):  # a full disk names no file, a failed mkstemp the temporary one: name `path`
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _name_list(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" ... and {len(names) - 5} more" if len(names) > 5 else "")


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class CheckpointReader:
    """Read tensors one at a time from a HF checkpoint directory; shards are opened lazily, each tensor is one
    read into its own buffer (no memory map: reading a whole model keeps one tensor resident at a time)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such checkpoint directory")
        self._handles: dict[str, object] = {}
        index = self.path / INDEX_FILE
        if index.exists() and (self.path / SINGLE_FILE).exists():  # transformers reads the file, we the index
            raise CheckpointError(f"{self.path}: holds both {SINGLE_FILE} and {INDEX_FILE}, so which weights are "
                                  "meant is unclear; remove the stale one")
        if index.exists():
            self._weight_map = self._read_index(index)
        elif (self.path / SINGLE_FILE).is_file():
            self._weight_map = {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        else:
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE} found")

    def _read_index(self, index: Path) -> dict[str, str]:
        weight_map = read_json(index, "checkpoint index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: corrupt index (no 'weight_map' object of tensor name -> file name)")
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard:
                raise CheckpointError(f"{index}: shard name '{shard}' must be a plain file name")
            if not (self.path / shard).is_file():
                raise CheckpointError(f"{self.path / shard}: shard listed in {INDEX_FILE} does not exist")
        return weight_map

    def _open(self, shard: str):
        if shard not in self._handles:
            file = self.path / shard
            try:
                self._handles[shard] = SafetensorsFile(file)
            except (SafetensorsError, OSError) as err:
                raise CheckpointError(f"{file}: not a valid safetensors file: {_one_line(err)}") from None
        return self._handles[shard]

    def _locate(self, name: str) -> Path:
        if name not in self._weight_map:
            raise CheckpointError(f"{self.path}: tensor '{name}' is not in the checkpoint")
        return self.path / self._weight_map[name]

    def _header(self, name: str) -> tuple[SafetensorsFile, Path]:
        file = self._locate(name)
        handle = self._open(file.name)
        if name not in handle.keys():
            raise CheckpointError(f"{file}: cannot read tensor '{name}': it is not in this shard")
        return handle, file

    def names(self) -> list[str]:
        return sorted(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        handle, _ = self._header(name)
        return handle.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        handle, _ = self._header(name)
        return DTYPES[handle.dtype(name)]

    def get(self, name: str, dtype: torch.dtype | None = None, check_finite: bool = True) -> torch.Tensor:
        """Load one tensor (only its bytes are read); optionally reject NaN/Inf and cast to `dtype`."""
        handle, file = self._header(name)
        try:
            tensor = handle.get_tensor(name)
        except (SafetensorsError, OSError) as err:
            raise CheckpointError(f"{file}: cannot read tensor '{name}': {_one_line(err)}") from None
        if check_finite and tensor.is_floating_point():
            self._check_finite(tensor, name, file)
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    @staticmethod
    def _check_finite(tensor: torch.Tensor, name: str, file: Path) -> None:
        wide = tensor.to(torch.float16) if tensor.element_size() == 1 else tensor  # fp8 lacks isnan/isinf
        if torch.isfinite(wide).all():
            return
        nans, infs = int(torch.isnan(wide).sum()), int(torch.isinf(wide).sum())
        raise CheckpointError(f"{file}: tensor '{name}' contains {nans} NaN and {infs} Inf values")

    def validate(
        self,
        expected: dict[str, tuple[tuple[int, ...], torch.dtype | None]],
        allow_missing: Iterable[str] = (),
        allow_unexpected: Iterable[str] = (),
    ) -> None:
        """Check names, shapes and dtypes against `expected` from headers only (dtype None = any float of 16 bits or
        more: an FP8 tensor carries scales this reader does not take, and would be read as unscaled values).

        `allow_missing` / `allow_unexpected` hold names or fnmatch patterns.
        """
        allow_missing, allow_unexpected = list(allow_missing), list(allow_unexpected)
        missing = sorted(n for n in expected if n not in self and not _matches(n, allow_missing))
        if missing:
            raise CheckpointError(f"{self.path}: missing {len(missing)} tensor(s): {_name_list(missing)}")
        unexpected = sorted(n for n in self._weight_map if n not in expected and not _matches(n, allow_unexpected))
        if unexpected:
            raise CheckpointError(f"{self.path}: {len(unexpected)} unexpected tensor(s): {_name_list(unexpected)}")
        problems = [self._mismatch(name, *spec) for name, spec in expected.items() if name in self]
        problems = [p for p in problems if p]
        if problems:
            more = f" (and {len(problems) - 1} more mismatched tensor(s))" if len(problems) > 1 else ""
            raise CheckpointError(problems[0] + more)

    def _mismatch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> str | None:
        file, got_shape, got_dtype = self._locate(name), self.shape(name), self.dtype(name)
        if got_shape != tuple(shape):
            return f"{file}: tensor '{name}' has shape {got_shape}, expected {tuple(shape)}"
        if dtype is None and not (got_dtype.is_floating_point and got_dtype.itemsize > 1):
            fp8 = got_dtype.is_floating_point  # the 1-byte floats
            return (f"{file}: tensor '{name}' has dtype {got_dtype}, expected a floating-point dtype of 16 bits or more"
                    + (" (an FP8 checkpoint: pass its bf16 original)" if fp8 else ""))
        if dtype is not None and got_dtype != dtype:
            return f"{file}: tensor '{name}' has dtype {got_dtype}, expected {dtype}"
        return None

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckpointWriter:
    """Write tensors into HF-named safetensors shards, holding at most one shard in memory at a time."""

    def __init__(
        self,
        path: str | Path,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        metadata: dict[str, str] | None = None,
        overwrite: bool = False,
    ) -> None:
        self.path = Path(path)
        self.max_shard_bytes = max_shard_bytes
        self._metadata = {**(metadata or {}), "format": "pt"}
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._written: list[Path] = []
        self._names: set[str] = set()
        self._total_size = 0
        self._closed = False
        self.files: list[Path] = []
        self.path.mkdir(parents=True, exist_ok=True)
        self._clear_old(overwrite)

    def _clear_old(self, overwrite: bool) -> None:
        old = sorted(self.path.glob("*.safetensors")) + [p for p in [self.path / INDEX_FILE] if p.exists()]
        if old and not overwrite:
            raise CheckpointError(f"{self.path}: already holds a checkpoint ({old[0].name}); pass overwrite=True")
        for file in old:
            file.unlink()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise CheckpointError(f"{self.path}: cannot add tensor '{name}', writer is closed")
        if name in self._names:
            raise CheckpointError(f"{self.path}: duplicate tensor '{name}'")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        tensor = tensor.detach()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.to("cpu").contiguous()
        if any(_shares_storage(tensor, t) for t in self._buffer.values()):
            tensor = tensor.clone()  # save_file rejects tensors sharing memory (tied weights, views)
        self._buffer[name] = tensor
        self._names.add(name)
        self._buffer_bytes += nbytes
        self._total_size += nbytes

    def _flush(self) -> None:
        file = self.path / f"model-{len(self._shards) + 1:05d}.partial.safetensors"
        self._written.append(file)
        save_safetensors(self._buffer, file, self._metadata)
        self._shards.append((file, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> list[Path]:
        """Flush the last shard, give shards their final HF names, write the index; return the files written."""
        if self.files:
            return self.files
        if self._closed:
            raise CheckpointError(f"{self.path}: writer was aborted; nothing was written")
        self._closed = True
        try:
            if not self._names:
                raise CheckpointError(f"{self.path}: no tensors were added; refusing to write an empty checkpoint")
            if self._buffer:
                self._flush()
            self.files = self._finalize()
            return self.files
        except BaseException:
            self.abort()
            raise

    def _finalize(self) -> list[Path]:
        n = len(self._shards)
        finals = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        weight_map: dict[str, str] = {}
        for (tmp, names), final in zip(self._shards, finals):
            self._written.append(self.path / final)
            tmp.rename(self.path / final)
            weight_map.update((name, final) for name in names)
        files = [self.path / f for f in finals]
        if n > 1:
            self._written.append(self.path / INDEX_FILE)
            write_json(self.path / INDEX_FILE, {"metadata": {"total_size": self._total_size}, "weight_map": weight_map})
            files.append(self.path / INDEX_FILE)
        return files

    def abort(self) -> None:
        """Drop buffered tensors and delete every file this writer created."""
        self._closed = True
        self._buffer, self._buffer_bytes = {}, 0
        for file in self._written:
            file.unlink(missing_ok=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def save_state_dict(
    path: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> list[Path]:
    """Stream (name, tensor) pairs into a sharded HF checkpoint at `path`; return the files written."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    with CheckpointWriter(path, max_shard_bytes, overwrite=overwrite) as writer:
        for name, tensor in items:
            writer.add(name, tensor)
    return writer.files


def save_checkpoint(out: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], cfg: BeamConfig | DrafterConfig,
                    absent: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    also: Callable[[Path], None] | None = None) -> Path:
    """Write a checkpoint folder to `out` atomically: `tensors` (save_state_dict) and `cfg` as config.json into a
    `staging` folder (`absent` as there), then also(folder) for the caller's own files, then `replace_dir`. A
    generator's tensors (and a progress bar it starts) are made only once the staging folder is held."""
    out = Path(out)
    with staging(out, absent) as tmp:
        save_state_dict(tmp, tensors, max_shard_bytes)
        cfg.save(tmp / "config.json")
        if also is not None:
            also(tmp)
        replace_dir(tmp, out)  # through a symbolic link at out, as every output is written
    return out
