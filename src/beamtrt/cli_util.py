"""Shared command-line plumbing: user errors become one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

from beamtrt.errors import BeamtrtError

T = TypeVar("T")


def torch_device(name: str, flag: str = "--device"):
    """A --device value -> torch.device on this host, or a one-line error (a bad name, no CUDA, no such GPU)."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise BeamtrtError(f"{flag} {name}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BeamtrtError(f"{flag} {name}: this host has no usable CUDA device (torch {torch.__version__}, "
                               f"CUDA build: {torch.version.cuda or 'no'})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise BeamtrtError(f"{flag} {name}: this host has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise BeamtrtError(f"{flag} {name}: only cpu and cuda devices are supported")
    return device


def run_cli(body: Callable[[], None]) -> int:
    try:
        body()
    except (BeamtrtError, ValueError) as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        print(f"error: {lines[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def run_ranks_cli(setup: Callable[[object], T], execute: Callable[[T, object], None]) -> int:
    """A command that runs as one process or as every rank of an mpirun job (beamtrt.runtime.dist.Dist).

    setup(dist) checks everything it can before any weight is loaded; its errors are the same on every rank, so under
    mpirun rank 0 prints the one line and every rank exits 2. execute(setup's result, dist) loads and runs; a later
    failure on any rank (a missing rank file, an exception, Ctrl-C) prints that rank's message and aborts every rank.
    """
    from beamtrt.runtime import tp
    from beamtrt.runtime.dist import Dist

    try:
        dist = Dist.create()
    except BeamtrtError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dist.size == 1:
        return run_cli(lambda: execute(setup(dist), dist))
    try:
        state = setup(dist)
    except (BeamtrtError, ValueError) as e:
        if dist.rank == 0:
            print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr, flush=True)
        return 2
    try:
        execute(state, dist)
    except (BeamtrtError, ValueError) as e:
        print(f"error: rank {dist.rank}: {str(e).strip().splitlines()[0]}", file=sys.stderr, flush=True)
        dist.abort(2)
    tp.stop(dist)
    return 0
