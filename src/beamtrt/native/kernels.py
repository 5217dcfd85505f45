"""The DFlash2 plugin kernels (plugins/) on torch tensors, for the torch backend's drafter: the CUDA build (the torch
extension, on CUDA devices) or the host build of the same math (plugins/host, through ctypes).

`kernels_for(device)` picks them: by default the CUDA kernels on a CUDA device and none on the CPU (there the drafter
takes the fused host step of `draft_step.cpp`, or PyTorch with `BEAMTRT_NATIVE=0`); `BEAMTRT_KERNELS=host` runs the
host build on the CPU (how the CPU tests drive the kernel path of the drafter end to end), `BEAMTRT_KERNELS=off` never
uses them.
"""

from __future__ import annotations

import ctypes
import sys
from functools import lru_cache
from pathlib import Path

import torch

from beamtrt.cli_util import switch
from beamtrt.errors import DeviceError
from beamtrt.native import compile_library

PLUGINS = Path(__file__).resolve().parents[3] / "plugins"
MAX_TOP_K, MAX_HEAD_DIM = 64, 256  # the kernels' fixed arrays: kernel.cuh's selector::kMaxK, kMaxHeadDim
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}  # numeric.cuh DType
_p, _i32, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class SelectorArgs(ctypes.Structure):  # plugins/block_selector/kernel.cuh: selector::Args
    _fields_ = [(n, _i32) for n in ("N", "S", "V", "K", "R", "codebookType", "logitsType")] + [
        (n, _p) for n in ("logits", "projected", "anchorIds", "predecessor", "successor", "temperature", "topP",
                          "uniforms", "draftIds", "candIds", "q")]


class AttentionArgs(ctypes.Structure):  # plugins/windowed_attention/kernel.cuh: windowed_attention::Args
    _fields_ = [(n, _i32) for n in ("N", "L", "C", "Hq", "Hkv", "D", "W", "ioType", "cacheType")] + [
        ("cacheScale", _f32), ("softmaxScale", _f32)] + [
        (n, _p) for n in ("q", "k", "v", "contextK", "contextV", "start", "count", "ringK", "ringV", "out")]


def _ptr(t: torch.Tensor) -> int:
    assert t.is_contiguous(), "the kernels take contiguous tensors"
    return t.data_ptr()


@lru_cache(maxsize=None)
def host_library() -> ctypes.CDLL:
    source = PLUGINS / "host" / "host_api.cpp"
    if not source.is_file():
        raise DeviceError(f"the plugins/ sources are not here ({PLUGINS})")
    lib = compile_library(source, ("-O2", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC"),  # as CMake builds it
                          "the plugin kernels' host build")
    if lib is None or lib.beamtrt_host_abi() != 1:
        raise DeviceError("the plugin kernels' host build is not available (see the line above)")
    return lib


class HostKernels:
    """plugins/host: the kernel math on CPU tensors (N requests run one after another)."""

    @staticmethod
    def block_selector(logits, projected, anchor_ids, predecessor, successor, temperature, top_p, uniforms,
                       top_k: int):
        N, S, V = logits.shape
        out = (torch.empty(N, S, dtype=torch.int32, device="cpu"),
               torch.empty(N, S, top_k, dtype=torch.int32, device="cpu"), torch.empty(N, S, top_k, device="cpu"))
        keep = [logits.contiguous(), projected.float().contiguous(), anchor_ids.int().contiguous(),
                predecessor.contiguous(), successor.contiguous(), temperature.float().contiguous(),
                top_p.float().contiguous(), uniforms.float().contiguous()]
        args = SelectorArgs(N, S, V, top_k, projected.shape[-1], DTYPES[predecessor.dtype], DTYPES[logits.dtype],
                            *map(_ptr, keep), *map(_ptr, out))
        host_library().beamtrt_block_selector_host(ctypes.byref(args))
        return out

    @staticmethod
    def windowed_attention(q, k, v, context_k, context_v, start, count, ring_k, ring_v, cache_scale: float = 1.0,
                           softmax_scale: float | None = None):
        N, L, Hq, D = q.shape
        io = [t.contiguous() for t in (q, k, v, context_k, context_v)]
        ints = [start.int().contiguous(), count.int().contiguous()]
        out = torch.empty_like(io[0])
        scale = softmax_scale if softmax_scale is not None else D ** -0.5
        args = AttentionArgs(N, L, context_k.shape[1], Hq, k.shape[2], D, ring_k.shape[2], DTYPES[q.dtype],
                             DTYPES[ring_k.dtype], cache_scale, scale, *map(_ptr, io + ints),
                             _ptr(ring_k), _ptr(ring_v), _ptr(out))
        host_library().beamtrt_windowed_attention_host(ctypes.byref(args))
        return out


class CudaKernels:
    """The CUDA build through the torch extension (beamtrt.native.cuda), built on first use."""

    @staticmethod
    def block_selector(*args, top_k: int):
        from beamtrt.native import cuda

        return cuda.block_selector(*args, top_k=top_k)

    @staticmethod
    def windowed_attention(*args, **kwargs):
        from beamtrt.native import cuda

        return cuda.windowed_attention(*args, **kwargs)


def beyond_kernels(cfg) -> str | None:
    """Why a drafter of DrafterConfig `cfg` is beyond the kernels' fixed arrays (None: within them). The host build
    overran them (a segmentation fault), the CUDA build refused it at the first draft."""
    if cfg.selector_top_k > MAX_TOP_K:
        return f"its selector_top_k {cfg.selector_top_k} is above the kernels' {MAX_TOP_K} candidates"
    if cfg.head_dim > MAX_HEAD_DIM:
        return f"its head_dim {cfg.head_dim} is above the kernels' {MAX_HEAD_DIM}"
    return None


def kernels_for(device: torch.device | str, cfg=None):
    """The kernels the drafter (of DrafterConfig `cfg`) should use on `device`, or None for the PyTorch reference
    (see the module doc): a drafter beyond the kernels' limits keeps the reference, and BEAMTRT_KERNELS=host asking for
    them is one line."""
    mode = switch("BEAMTRT_KERNELS")
    device = torch.device(device)
    if mode == "off":
        return None
    if cfg is not None and (why := beyond_kernels(cfg)):
        if mode == "host" and device.type == "cpu":
            raise DeviceError(f"BEAMTRT_KERNELS=host: the drafter does not fit the plugin kernels ({why}); unset it to "
                              "run the drafter on the CPU's own path")
        if device.type == "cuda" and mode == "auto":
            print(f"beamtrt: the drafter does not fit the CUDA kernels ({why}); it runs on the PyTorch reference",
                  file=sys.stderr)
        return None
    if device.type == "cuda":
        if mode != "auto":
            return None
        try:
            from beamtrt.native import cuda

            cuda.extension()  # built once per machine (a minute or two), then loaded from the cache
        except Exception as e:  # no nvcc, no plugins/ sources, a failed build: the PyTorch reference still works
            why = str(e).splitlines()[0] if str(e) else repr(e)
            print(f"beamtrt: the CUDA kernels are not available ({why}); the drafter runs on the PyTorch reference",
                  file=sys.stderr)
            return None
        return CudaKernels
    if mode == "host" and device.type == "cpu":
        host_library()  # built (or found) now: a missing compiler is said before the model decodes, not mid-answer
        return HostKernels
    return None
