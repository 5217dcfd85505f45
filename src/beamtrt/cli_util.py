"""Shared command-line plumbing: user errors become one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from typing import Callable

from beamtrt.errors import BeamtrtError


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
