"""The plugins' CUDA kernels as a PyTorch extension (plugins/torch_ext), built on first use on a CUDA host.

The same launchers the TensorRT plugins call (plugins/*/kernel.cu), on torch tensors: the GPU tests and the kernel
micro-benchmark (scripts/gpu_check.sh) use them. Built with torch.utils.cpp_extension for the local GPU's
architecture into the beamtrt cache (see beamtrt.native.cache_dir).
"""

from __future__ import annotations

import subprocess
import sys
from functools import lru_cache

import torch

from beamtrt.errors import DeviceError
from beamtrt.native import cache_dir
from beamtrt.native.kernels import PLUGINS

# the launchers through torch_ext/'s one-line includes: load() names each object after its source's file name
SOURCES = ("torch_ext/extension.cpp", "torch_ext/block_selector.cu", "torch_ext/windowed_attention.cu")


@lru_cache(maxsize=None)
def extension():
    """The compiled extension module (raises where there is no CUDA device or no plugins/ source tree)."""
    from torch.utils.cpp_extension import load

    if not torch.cuda.is_available():
        raise DeviceError("the CUDA kernels need a CUDA device")
    missing = [s for s in SOURCES if not (PLUGINS / s).is_file()]
    if missing:
        raise DeviceError(f"the plugins/ sources are not here ({PLUGINS}): {', '.join(missing)}")
    arch, build, log = _arch(), _build_dir(), build_log()
    build.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    if not any(build.glob("*.so")):
        print(f"beamtrt: building the CUDA kernels for sm_{arch} into {build} (a minute or two, once)", file=sys.stderr,
              flush=True)
    try:
        return load(name="beamtrt_cuda", sources=[str(PLUGINS / s) for s in SOURCES], build_directory=str(build),
                    extra_include_paths=[str(PLUGINS)], extra_cflags=["-O3", "-std=c++20"],
                    extra_cuda_cflags=["-O3", "-std=c++17", "--threads=0",  # torch's own target and this one at once
                                       f"--generate-code=arch=compute_{arch},code=sm_{arch}"])
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:  # no nvcc or ninja, a compile error
        log.write_text(f"{type(e).__name__}: {e}\n")  # the compiler's output: ninja's command lines first
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        why = next((line for line in lines[1:] if "error" in line.lower()), lines[0])  # the compiler's first error
        raise DeviceError(f"building the CUDA kernels failed ({why[:200]}{' ...' if len(why) > 200 else ''}); the "
                          f"compiler's output is in {log}") from None


def _arch() -> str:
    """The current CUDA device's architecture as the build names it: arch-specific from Hopper on (sm_90a, sm_100a,
    sm_103a, as build/engine.py's cuda_archs hands them to CMake)."""
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}" + ("a" if major >= 9 else "")


def _build_dir():
    """The extension's build folder for the current device's architecture."""
    return cache_dir() / "cuda" / f"sm_{_arch()}"


def build_log():
    """Where a failed build of the extension for the current device leaves the compiler's output (None: no device)."""
    return _build_dir() / "build.log" if torch.cuda.is_available() else None


def _launch(kernel, *args):
    """kernel(*args, stream) on the device holding its first argument (the kernels launch on the current device; a
    drafter on cuda:1 would have launched on cuda:0), in that device's current torch stream."""
    device = args[0].device
    if device.type != "cuda":  # the extension refuses it in one line, naming the device
        return kernel(*args, 0)
    with torch.cuda.device(device):
        return kernel(*args, torch.cuda.current_stream(device).cuda_stream)


def block_selector(logits: torch.Tensor,       # [N, S, V] fp32
                   projected: torch.Tensor,    # [N, S, R] fp32: W_h h_t
                   anchor_ids: torch.Tensor,   # [N] int32
                   predecessor: torch.Tensor,  # [V, R] fp32 / fp16 / bf16
                   successor: torch.Tensor,    # [V, R] same dtype
                   temperature: torch.Tensor,  # [N] fp32, 0 = greedy
                   top_p: torch.Tensor,        # [N] fp32
                   uniforms: torch.Tensor,     # [N, S] fp32
                   top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (draft_ids [N, S] int32, cand_ids [N, S, K] int32, q [N, S, K] fp32), as plugins/block_selector."""
    return tuple(_launch(extension().block_selector, logits, projected, anchor_ids, predecessor, successor, temperature,
                         top_p, uniforms, top_k))


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # [N, L, H(q|kv), D]
                       context_k: torch.Tensor, context_v: torch.Tensor,   # [N, C, Hkv, D]
                       start: torch.Tensor, count: torch.Tensor,           # [N] int32
                       ring_k: torch.Tensor, ring_v: torch.Tensor,         # [N, Hkv, W, D], updated in place
                       cache_scale: float = 1.0, softmax_scale: float | None = None,
                       cuda_cores: bool = False) -> torch.Tensor:
    """-> out [N, L, Hq, D], as plugins/windowed_attention (an fp8 ring holds values / cache_scale). cuda_cores:
    skip the tensor-core kernel even where it applies (to compare the two)."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _launch(extension().windowed_attention, q, k, v, context_k, context_v, start, count, ring_k, ring_v,
                   cache_scale, scale, cuda_cores)
