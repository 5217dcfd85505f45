"""Shared command-line plumbing: user errors become one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import copy
import errno
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator, NoReturn, TypeVar

from beamtrt.errors import BeamtrtError, DeviceError

T = TypeVar("T")


class _HelpFormatter(argparse.HelpFormatter):
    def _expand_help(self, action: argparse.Action) -> str:  # a list default reads as it is typed: 1 2 4
        if isinstance(action.default, (list, tuple)):
            action = copy.copy(action)
            action.default = " ".join(map(str, action.default))
        return super()._expand_help(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with this project's error form: a bad flag or value is one `error:` line and exit 2 (the usage stays
    in --help), printed once under mpirun (by rank 0: every rank parses the same arguments), as --help is. An empty
    value (an unset shell variable: `--model "$MODEL"`) is refused for every flag but those named in `empty_ok`: as a
    path it would mean the working directory, or the flag's default. A flag of several values given twice is refused
    too: the second would replace the first's values."""

    def __init__(self, *args, empty_ok: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(*args, formatter_class=kwargs.pop("formatter_class", _HelpFormatter), **kwargs)
        self.empty_ok = frozenset(empty_ok)
        self.given: set[argparse.Action] = set()  # the flags of several values given so far

    def parse_known_args(self, args=None, namespace=None):
        self.given = set()
        return super().parse_known_args(args, namespace)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]):
        if "" in arg_strings and not self.empty_ok.intersection(action.option_strings):
            raise argparse.ArgumentError(action, "an empty value (an unset shell variable?)")
        if action.nargs in ("+", "*") and action.option_strings:
            if action in self.given:
                raise argparse.ArgumentError(action, f"given twice; give all its values after one "
                                                     f"{action.option_strings[-1]}")
            self.given.add(action)
        values = super()._get_values(action, arg_strings)
        if action.nargs == "+" and (twice := next((v for i, v in enumerate(values) if v in values[:i]), None)):
            raise argparse.ArgumentError(action, f"{twice} given twice")  # measured twice, or the same data
        return values

    def error(self, message: str) -> NoReturn:
        if _first_rank():
            sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        sys.exit(2)

    def print_help(self, file=None) -> None:  # --help
        if _first_rank():
            super().print_help(file)


def _first_rank() -> bool:
    """Not an mpirun rank, or its rank 0: the one that prints what every rank's parse of the same arguments says."""
    return os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")) == "0"


def progress(total: int, desc: str, unit: str = "point", quiet: bool = False, scale: bool = False):
    """A bar over a command's work (a benchmark's measurements, a model's tensors as they load), drawn on a terminal
    only (piped, a benchmark's output stays its JSON lines), and not at all when `quiet`; cleared when done. `scale`:
    counts shown with SI prefixes (bytes: MB, GB)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=quiet or None, dynamic_ncols=True, leave=False,
                unit_scale=scale)


def say(bar, line: str, file) -> None:
    """`line` on `file` (now, even when piped) above `bar`, a `progress` bar."""
    bar.write(line, file=file)
    file.flush()


def torch_device(name: str):
    """A --device value -> torch.device on this host, or a one-line error (a bad name, no CUDA, no such GPU)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise BeamtrtError(f"--device {name}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BeamtrtError(f"--device {name}: this host has no usable CUDA device (torch {torch.__version__}, "
                               f"CUDA build: {torch.version.cuda or 'no'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BeamtrtError(f"--device {name}: this host has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise BeamtrtError(f"--device {name}: only cpu and cuda devices are supported")
    return device


def description(doc: str) -> str:
    """A module docstring's first paragraph as one line: the --help description of the command it documents."""
    return doc.split("\n\n")[0].replace("\n", " ")


def check_threads(n: int) -> None:
    """A --threads value: 0 (torch's default) or a thread count, at most 4 per core (torch crashes far above)."""
    cores = os.cpu_count() or 1
    if not 0 <= n <= 4 * cores:
        raise BeamtrtError(f"--threads must be in [0, {4 * cores}] (0 = torch's default; this host has {cores} cores), "
                           f"got {n}")


def check_seed(n: int, flag: str = "--seed", bits: int = 63) -> None:
    """A seed torch's generators take: [0, 2**63), or [0, 2**bits) where seeds are derived from it by arithmetic."""
    if not 0 <= n < 2**bits:
        raise BeamtrtError(f"{flag} must be in [0, 2**{bits}), got {n}")


def existing(path: str | Path) -> Path:
    """`path` (absolute, symbolic links followed: an output is written through one) if it exists, else its nearest
    existing ancestor: where writing it would start."""
    found = Path(os.path.realpath(path))
    while not found.exists():
        found = found.parent
    return found


def size_text(n: int) -> str:
    """A byte count as people read it: 1.5 GB, or 300.0 MB below a gigabyte."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def free_bytes(path: str | Path) -> int:
    """Free disk space where `path` would be written (its nearest existing folder)."""
    import shutil

    return shutil.disk_usage(existing(path)).free


def check_room(need: int, out: str | Path, what: str) -> None:
    """A one-line BeamtrtError when `need` bytes written at `out` would not fit the disk there ("{what} is a ... GB
    checkpoint; FOLDER has ... GB free")."""
    free = free_bytes(out)
    if need > free:
        raise BeamtrtError(f"{what} is a {need / 1e9:.4g} GB checkpoint; {existing(out)} has {free / 1e9:.4g} GB free")


@contextmanager
def ending_with_us(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """A child command waited for inside: if this command is interrupted meanwhile (Ctrl-C, SIGTERM), the child gets
    the same signal and is waited for, so that its own clean-up (a build's temporary folder) is done before this one
    goes on (subprocess.run kills it after a quarter of a second; a bare wait leaves it running on). A child started
    in a session of its own (an mpirun job: start_new_session) gets it with its whole process group, as a scheduler
    sends it (scripts/mpirun passes on no signal sent to it alone: its ranks ran on)."""
    try:
        yield proc
    except KeyboardInterrupt as e:
        if proc.poll() is None:
            sig = e.args[0] if isinstance(e, Terminated) else signal.SIGINT
            try:
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
            except ProcessLookupError:  # it ended meanwhile
                pass
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise


def run_child(cmd: list[str], **popen: object) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, **popen), ending the child as ending_with_us does."""
    with ending_with_us(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         **popen)) as proc:
        out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def child_error(stderr: str, returncode: int) -> str:
    """Why a child command failed, in one line: its own `error:` line (under mpirun, Open MPI's notices follow it),
    else a compiler's or CMake's first error (`file:line: error: ...`, `CMake Error at ...`: make's closing lines
    follow it), else its last line of output, else how it ended (a rank or build killed, for example, prints
    nothing)."""
    lines = [line.strip() for line in stderr.replace("\0", "").splitlines() if line.strip()]
    mine = [line for line in lines if line.startswith("error:")]
    if mine:
        return mine[0].removeprefix("error:").strip()
    tools = [line for line in lines if re.search(r": (fatal )?error:|^CMake Error", line)]
    if tools:
        return tools[0]
    if lines:
        return lines[-1]
    return f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}, no output"


def set_threads(n: int) -> None:
    """--threads N: torch's CPU threads; 0 keeps torch's default."""
    import torch

    check_threads(n)
    if n:
        torch.set_num_threads(n)


def output_path(path: str | Path, flag: str, *, directory: bool = False, replaced: bool = True) -> Path:
    """Checks an output path before the work that fills it: it must not be a directory where a file goes (or the
    reverse), and its nearest existing ancestor must be a writable directory (missing folders are made at write).
    A `directory` that is `replaced` whole (written beside and renamed into place) may not hold the current
    directory, nor be a mount point."""
    from beamtrt.checkpoint.hf import MOUNT_POINT, holds_cwd, is_mount

    p = Path(path)
    if str(path) == "-":  # not standard output: a file named '-' was written
        what = "folder" if directory else "file"
        raise BeamtrtError(f"{flag} -: give a {what} path (this writes no standard output)")
    if directory and replaced and holds_cwd(p):
        raise BeamtrtError(f"{flag} {p}: is the current directory or holds it; an output directory is written beside "
                           "and renamed into place, so choose another")
    if directory and replaced and is_mount(p):
        raise BeamtrtError(f"{flag} {p}: {MOUNT_POINT}")
    if not directory and p.exists() and not p.is_dir() and not p.is_file():
        raise BeamtrtError(f"{flag} {p}: not a regular file (a device, a pipe or a socket); give a file path")
    if p.exists() and p.is_dir() != directory:
        what = "directory" if not directory else "file" if p.is_file() else "device, a pipe or a socket"
        raise BeamtrtError(f"{flag} {p}: is a {what}; expected a {'directory' if directory else 'file'} path")
    ancestor = existing(Path(os.path.realpath(p)).parent)  # through a link at p, as outputs are written
    if not ancestor.is_dir():
        raise BeamtrtError(f"{flag} {p}: {ancestor} is a file, not a directory")
    try:
        probe_writable(ancestor)
    except OSError as e:
        raise BeamtrtError(f"{flag} {p}: cannot write in {ancestor} ({e.strerror or e})") from None
    return p


def probe_writable(folder: Path) -> None:
    """An OSError where `folder` takes no new file: a folder made in it and removed, not os.access (root passes
    access(2) on /proc or a read-only export, and writes fail)."""
    os.rmdir(tempfile.mkdtemp(prefix=".beamtrt-probe-", dir=folder))


def outside_inputs(path: str | Path, flag: str, reads: Iterable[tuple[str, str | Path | None]]) -> None:
    """An output file is none of the files and folders (what, path) the command reads, nor inside one: written there it
    would replace a checkpoint's config.json or a cache's meta.json, or add a file a build's manifest does not list."""
    from beamtrt.checkpoint.hf import holds

    for what, d in reads:
        if d is not None and holds(d, path):
            raise BeamtrtError(f"{flag} {path}: {'is' if holds(path, d) else 'is inside'} {what} {d}, which this "
                               "command reads; choose another place")


WORK_MARK = ".beamtrt-work"  # names the benchmark whose scratch folder this is


def work_dir(path: str | Path, owner: str, make: bool = True) -> Path:
    """A benchmark's scratch folder, whose contents it deletes and replaces: a new or empty folder, or one this
    benchmark marked before (a user's --work ~/models would otherwise lose its models). make=False: the checks alone,
    for a benchmark that has minutes of other work before it writes there."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise BeamtrtError(f"--work {p}: is a file; expected a directory path")
    mark = p / WORK_MARK
    if p.is_dir() and any(p.iterdir()) and not (mark.is_file() and mark.read_text(errors="replace").strip() == owner):
        raise BeamtrtError(f"--work {p}: holds files that {owner} did not make there, and it replaces what it "
                           "finds in its folder; give a new or empty one")
    if not make:
        return p
    p.mkdir(parents=True, exist_ok=True)
    mark.write_text(owner + "\n")
    return p


_DESTINATION_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


def error_line(e: BaseException) -> str:
    """One line for a user error; an OSError names its path (a folder that is a file, no space, no permission): of a
    copy's two, the destination where its file system is at fault (full, over quota, read-only)."""
    if isinstance(e, OSError) and e.strerror:
        path = e.filename2 if e.filename2 and e.errno in _DESTINATION_ERRORS else e.filename
        return f"{path}: {e.strerror}" if path else e.strerror
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:  # copytree's (src, dst,
        src, _, why = e.args[0][0]                                                             # why) per failed file
        more = f" (and {len(e.args[0]) - 1} more files)" if len(e.args[0]) > 1 else ""
        return f"copying {src}: {why}{more}"
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return lines[0]


def _out_of_memory(e: BaseException) -> str | None:
    """The one line for an allocation the host could not make (Python's MemoryError, torch's CPU allocator, a CUDA
    OOM), or None for any other error."""
    if isinstance(e, MemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e).lower():
        return f"out of memory ({error_line(e) or 'MemoryError'}): ask for smaller sizes"
    return None


def say_last(line: str) -> None:
    """A command's closing line on stderr (its error, or why it stopped), after closing the progress bars still
    drawing, so that it starts on a line of its own and stays the last. One write: under `mpirun --output :raw` the
    lines of ranks that speak at once do not interleave."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    sys.stderr.write(line + "\n")  # print() writes the line and its newline apart
    sys.stderr.flush()


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C would be so that the same clean-up runs (temporary outputs removed)."""


def _terminate(signum: int, frame) -> None:
    raise Terminated(signum)


class _Output:
    """stdout or stderr, kept writable when its reader goes away (`run.py --json F | head -1`): from the first broken
    pipe on, what is written is dropped, and the command goes on to write its files and exit as it would have."""

    def __init__(self, stream):
        self._stream, self._gone = stream, False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self._gone = True
        devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's last flush of the buffer must not fail
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def usable_outputs() -> Iterator[None]:
    """stdout and stderr as a command needs them while it runs: a closed one (`2>&-`, as cron and daemons may start a
    process) is os.devnull, not None, and a reader that goes away (a broken pipe) stops the printing, not the
    command. A closed stdout is said on stderr: what the command prints (run.py's answers) is lost."""
    saved = sys.stdout, sys.stderr
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w"))
        elif not isinstance(stream, _Output):
            setattr(sys, name, _Output(stream))
    if saved[0] is None:
        print("warning: stdout is closed: what this command prints is dropped (its output files are written)",
              file=sys.stderr, flush=True)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def run_cli(body: Callable[[], None]) -> int:
    """Runs one process's command: user errors give one `error:` line and exit 2; Ctrl-C, SIGTERM and SIGHUP unwind
    through the command's clean-up and exit 128 + the signal's number."""
    with usable_outputs():
        return _run_cli(body)


# The environment switches (README): name -> (default, what the refusal says is expected, the values)
SWITCHES = {"BEAMTRT_NATIVE": ("1", "0 (PyTorch) or 1 (the host kernels, the default)", ("0", "1")),
            "BEAMTRT_KERNELS": ("auto", "auto, host or off", ("auto", "host", "off"))}


def switch(name: str) -> str:
    """An environment switch's value (its default where unset); any other value is one line."""
    default, expected, values = SWITCHES[name]
    if (value := os.environ.get(name, default)) not in values:
        raise DeviceError(f"{name}={value}: expected {expected}")
    return value


def check_switches() -> None:
    """Every switch, at a command's start: they were read at the first forward, after the models loaded, and not at
    all by a command that never reaches one."""
    for name in SWITCHES:
        switch(name)


def _run_cli(body: Callable[[], None]) -> int:
    sigs = (signal.SIGTERM, signal.SIGHUP)
    main = threading.current_thread() is threading.main_thread()  # only there can handlers be set
    saved = {sig: signal.getsignal(sig) for sig in sigs} if main else {}
    try:
        try:
            for sig, handler in saved.items():
                if handler is signal.SIG_DFL:  # one a host installed (a test runner, an embedding program) stays
                    signal.signal(sig, _terminate)
            check_switches()
            body()
        except (BeamtrtError, ValueError, OSError) as e:
            say_last(f"error: {error_line(e)}")
            return 2
        except (MemoryError, RuntimeError) as e:  # a size asked for beyond this host's memory: torch's own message
            if (line := _out_of_memory(e)) is None:
                raise
            say_last(f"error: {line}")
            return 2
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
    except KeyboardInterrupt as e:  # also one that lands while the handlers are restored, after the work
        return ended_by(e.args[0] if isinstance(e, Terminated) else signal.SIGINT)
    return 0


@contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP wait for the block to end, then the first arrives as it would have (it ends the
    command): for steps that must all happen or none (the renames of several output files). A block that fails keeps
    its error (the command ends on it). Ignored signals stay ignored; off the main thread (where no handler can be
    set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for sig, handler in saved.items():
            if handler not in (signal.SIG_IGN, None):  # None: set outside Python, which cannot put it back
                signal.signal(sig, lambda number, frame: held.append(number))
        yield
    finally:
        for sig, handler in saved.items():
            if handler not in (signal.SIG_IGN, None):
                signal.signal(sig, handler)
    if held:  # not reached when the block failed
        signal.raise_signal(held[0])


def ended_by(signum: int) -> int:
    """Says how a signal ended the command (Ctrl-C: `interrupted`; SIGTERM, SIGHUP: `terminated`) and returns its exit
    status, 128 + the signal's number."""
    say_last("interrupted" if signum == signal.SIGINT else "terminated")
    return 128 + signum


SETUP_PATIENCE_S = 60.0  # how long a rank whose setup failed waits for the others to finish theirs


def run_ranks_cli(setup: Callable[[object], T], execute: Callable[[T, object], None]) -> int:
    """A command that runs as one process or as every rank of an mpirun job (beamtrt.runtime.dist.Dist).

    setup(dist) checks everything it can before any weight is loaded. Under mpirun the ranks then agree on how it went:
    when it failed on any rank, rank 0 prints one line (the error, naming its rank unless every rank failed alike) and
    every rank exits 2; a rank that failed where another never arrives (it waits on input only it lacks) prints its
    own line and aborts every rank after SETUP_PATIENCE_S. execute(setup's result, dist) loads and runs; a later
    failure on any rank (a missing rank file, an exception, Ctrl-C) prints that rank's message and aborts every rank.
    """
    with usable_outputs():
        return _run_ranks_cli(setup, execute)


def _run_ranks_cli(setup: Callable[[object], T], execute: Callable[[T, object], None]) -> int:
    from beamtrt.runtime import tp
    from beamtrt.runtime.dist import Dist

    try:
        dist = Dist.create()
    except BeamtrtError as e:  # every rank (mpi4py missing)
        say_last(f"error: {e}")
        return 2
    if dist.size == 1:
        return run_cli(lambda: execute(setup(dist), dist))
    state, failed = None, None
    try:
        check_switches()
        state = setup(dist)
    except (BeamtrtError, ValueError, OSError) as e:  # maybe on this rank alone (a file only some nodes have)
        failed = error_line(e)
    flags = dist.agree(failed is not None, SETUP_PATIENCE_S)  # a rank returning alone would wait in MPI_Finalize
    if flags is None:
        say_last(f"error: rank {dist.rank}: {failed} (and some rank did not finish its setup)")
        dist.abort(2)
    if any(flags):
        lines = dist.gather(failed)
        if dist.rank == 0:
            first, line = next((r, line) for r, line in enumerate(lines) if line is not None)
            say_last(f"error: {line}" if lines == [line] * dist.size else f"error: rank {first}: {line}")
        return 2
    try:
        execute(state, dist)
    except (BeamtrtError, ValueError, OSError) as e:
        say_last(f"error: rank {dist.rank}: {error_line(e)}")
        dist.abort(2)
    except (MemoryError, RuntimeError) as e:
        if (line := _out_of_memory(e)) is None:
            raise
        say_last(f"error: rank {dist.rank}: {line}")
        dist.abort(2)
    tp.stop(dist)
    return 0
