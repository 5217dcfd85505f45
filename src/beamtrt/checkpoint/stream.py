"""safetensors files read and written piece by piece: a reader that fetches one tensor with one pread (no memory
map, so reading a whole checkpoint never grows the resident set), and a writer whose tensors are declared up front
and written one piece at a time (streaming conversion)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from beamtrt.errors import CheckpointError

_CODES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}

DTYPES = {code: dtype for dtype, code in _CODES.items()} | {"U16": torch.uint16, "I16": torch.int16,
                                                              "U32": torch.uint32, "U64": torch.uint64}
Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one tensor
_MAX_HEADER = 100 * 1024 * 1024


def _count(v: object) -> bool:
    """A shape dimension or data offset as the format allows it: a JSON integer >= 0 (not a bool, float or string)."""
    return type(v) is int and v >= 0


class SafetensorsError(ValueError):
    """The file is not a well-formed safetensors file (the message says why)."""


class SafetensorsFile:
    """Read a safetensors file tensor by tensor: the header is parsed once, each tensor is one pread."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError("file too short for a header")
            n = int.from_bytes(raw, "little")
            if n > min(_MAX_HEADER, size - 8):
                raise SafetensorsError(f"header length {n} exceeds the file")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # the last: nested too deeply
                raise SafetensorsError("header is not valid JSON") from None
        if not isinstance(header, dict):
            raise SafetensorsError("header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict):
            raise SafetensorsError("header's __metadata__ is not a JSON object")
        self.base = 8 + n
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                code, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"bad header entry for {name!r}") from None
            if not (isinstance(code, str) and all(_count(v) for v in (*shape, begin, end))):
                raise SafetensorsError(f"bad header entry for {name!r} (dtype, shape or offsets of the wrong type)")
            if code not in DTYPES:
                raise SafetensorsError(f"tensor {name!r} has unsupported dtype {code}")
            if not 0 <= begin <= end or end - begin != DTYPES[code].itemsize * math.prod(shape):
                raise SafetensorsError(f"tensor {name!r} has inconsistent data offsets")
            if self.base + end > size:
                raise SafetensorsError(f"file is truncated (tensor {name!r} ends past its end)")
            self._entries[name] = (code, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> str:
        return self._entries[name][0]

    def get_tensor(self, name: str) -> torch.Tensor:
        code, shape, begin, end = self._entries[name]
        buf = bytearray(end - begin)
        view, done = memoryview(buf), 0
        with open(self.path, "rb", buffering=0) as f:
            while done < len(buf):  # one pread moves at most ~2 GiB
                got = os.preadv(f.fileno(), [view[done:]], self.base + begin + done)
                if got <= 0:
                    raise SafetensorsError(f"short read of {name!r} (file truncated?)")
                done += got
        if not buf:
            return torch.empty(shape, dtype=DTYPES[code])
        return torch.frombuffer(buf, dtype=DTYPES[code]).reshape(shape)


def nbytes(spec: Spec) -> int:
    shape, dtype = spec
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class StreamingSafetensors:
    """Write the header for `specs` first, then each tensor (or each slice along its first dim) at its offset.

    Peak memory is one piece, whatever the file's size. close() fails if any piece was never written, and write()
    if a piece is written twice or lies outside its tensor.
    """

    def __init__(self, path: str | Path, specs: dict[str, Spec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = dict(sorted(specs.items()))
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self._offset: dict[str, int] = {}
        offset = 0
        for name, spec in self.specs.items():
            size = nbytes(spec)
            header[name] = {"dtype": _CODES[spec[1]], "shape": list(spec[0]), "data_offsets": [offset, offset + size]}
            self._offset[name] = offset
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self._base = 8 + len(raw)
        self._rows = {name: shape[0] if shape else 1 for name, (shape, _) in self.specs.items()}
        self._written: dict[str, set[int]] = {name: set() for name in self.specs}  # rows of the first dim
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self._fd, len(raw).to_bytes(8, "little") + raw)
        os.ftruncate(self._fd, self._base + offset)

    def write(self, name: str, tensor: torch.Tensor, index: int | None = None) -> None:
        """Write the whole tensor, or row `index` of its first dim (e.g. one expert of a stacked weight)."""
        shape, dtype = self.specs[name]
        want = shape if index is None else shape[1:]
        what = f"{name}{'' if index is None else f'[{index}]'}"
        if tuple(tensor.shape) != tuple(want) or tensor.dtype != dtype:
            raise CheckpointError(f"{self.path}: internal error: {what} is {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"declared {tuple(want)} {dtype}")
        rows = set(range(self._rows[name])) if index is None else {index}
        if index is not None and not (shape and 0 <= index < shape[0]):
            raise CheckpointError(f"{self.path}: internal error: {what} is outside its {tuple(shape)}")
        if rows & self._written[name]:
            raise CheckpointError(f"{self.path}: internal error: {what} written twice")
        data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()  # no copy
        start = self._offset[name] + (0 if index is None else index * data.nbytes)
        view, done = data.data, 0
        try:
            while done < data.nbytes:  # one pwrite moves at most ~2 GiB; a full disk ends the next one in ENOSPC
                wrote = os.pwrite(self._fd, view[done:], self._base + start + done)
                if wrote <= 0:
                    raise CheckpointError(f"{self.path}: short write of {name!r}")
                done += wrote
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot write {name!r} ({e.strerror or e})") from None
        self._written[name] |= rows

    def close(self) -> None:
        fd, self._fd = self._fd, None  # closed once, however close() ends (abort() after it must not close it again)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        unwritten = [name for name, rows in self._rows.items() if len(self._written[name]) != rows]
        if unwritten:
            raise CheckpointError(f"{self.path}: internal error: {len(unwritten)} tensor(s) not fully written, "
                                  f"first {unwritten[0]!r}")

    def abort(self) -> None:
        """Delete the file (closing it first unless close() already did: its descriptor may be another's by now)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        self.path.unlink(missing_ok=True)
