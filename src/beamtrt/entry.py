"""What every command's script runs: the command's main(), its start-up imports shielded from Ctrl-C and SIGTERM."""

from __future__ import annotations

import importlib
import signal

from beamtrt.cli_util import ended_by

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run(module: str) -> int:
    """Imports torch and `module` (about a second) and returns `module`'s main(). A signal that lands during the
    imports would end them in a traceback, or an abort inside torch's C++; it is held until they are done, then
    ends the command as it would later: `interrupted` / `terminated` and 128 + its number. Signals that are ignored
    (a background job's Ctrl-C) or handled by whoever started us keep their disposition."""
    held: list[int] = []
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig, handler in saved.items():
        if handler in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, lambda number, frame: held.append(number))
    try:
        importlib.import_module("torch")  # first: every command but --help needs it, and a signal in its import
        main = importlib.import_module(module).main  # elsewhere (a command's own lazy import) aborts in C++
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return ended_by(held[0]) if held else main()
