"""Shared command-line plumbing: user errors become one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import sys
from typing import Callable

from beamtrt.errors import BeamtrtError


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
