"""PyTorch stand-ins for the TensorRT-LLM names beamtrt.build.drafter_net is written with, so the network's own code
runs on CPU (its plugins through their host build) and can be compared with the reference drafter.

Each stand-in does what the TensorRT-LLM function does to shapes and values (docs/trtllm-api.md): `concat` of ints
and 0-d shape tensors builds a shape, `slice` takes start indices and a shape tensor of sizes, `view` / `expand`
take shape tensors, elementwise ops broadcast by rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as TF

from beamtrt.native.kernels import HostKernels


class T:
    """A tensor of the network under construction (here: its value)."""

    def __init__(self, value: torch.Tensor, shape: bool = False):
        self.t, self.is_shape = value, shape

    @property
    def trt_tensor(self):
        return self

    def view(self, shape: T) -> T:
        return T(self.t.reshape(shape.t.tolist()))

    def mark_output(self, name: str, dtype=None) -> None:
        OUTPUTS[name] = self.t

    def __mul__(self, other: T) -> T:
        return T(self.t * other.t)

    def __add__(self, other: T) -> T:
        return T(self.t + other.t)


OUTPUTS: dict[str, torch.Tensor] = {}


def _concat(items: list, dim: int = 0) -> T:
    if any(isinstance(i, int) or i.is_shape for i in items):  # a shape: ints and 0-d shape tensors
        return T(torch.tensor([i if isinstance(i, int) else int(i.t) for i in items]), shape=True)
    return T(torch.cat([i.t for i in items], dim))


def _slice(x: T, starts: list[int], sizes: T) -> T:
    return T(x.t[tuple(slice(s, s + n) for s, n in zip(starts, sizes.t.tolist()))])


def _rms_norm(x: T, size: int, weight: T, eps: float) -> T:
    return T(TF.rms_norm(x.t, (size,), weight.t, eps))


F = SimpleNamespace(
    constant=lambda value: T(value),
    shape=lambda x, dim: T(torch.tensor(x.t.shape[dim]), shape=True),
    concat=_concat,
    slice=_slice,
    expand=lambda x, shape: T(x.t.expand(shape.t.tolist())),
    unsqueeze=lambda x, axis: T(x.t.unsqueeze(axis)),
    matmul=lambda a, b, transb=False: T(a.t @ (b.t.transpose(-1, -2) if transb else b.t)),
    rms_norm=_rms_norm,
    silu=lambda x: T(TF.silu(x.t)),
    embedding=lambda ids, weight, **_: T(weight.t[ids.t.long()]),
    cast=lambda x, dtype: T(x.t.to(dtype)),
    _create_tensor=lambda tensor, layer: tensor,
)


class _Layer:
    def __init__(self, *outputs: torch.Tensor):
        self.outputs = outputs

    def get_output(self, i: int) -> T:
        return T(self.outputs[i])


def _attention(net, q, k, v, ck, cv, start, count, ring_k, ring_v, *, window: int, **_):
    assert ring_k.t.shape[2] == window and ring_k.t.is_contiguous()
    out = HostKernels.windowed_attention(q.t, k.t, v.t, ck.t, cv.t, start.t, count.t, ring_k.t, ring_v.t)
    return _Layer(out, ring_k.t, ring_v.t)  # the rings were updated in place, as the aliased plugin outputs are


def _selector(net, logits, projected, anchor_ids, predecessor, successor, temperature, top_p, uniforms, *, top_k):
    return _Layer(*HostKernels.block_selector(logits.t, projected.t, anchor_ids.t, predecessor.t, successor.t,
                                              temperature.t, top_p.t, uniforms.t, top_k=top_k))


class Module:
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def torch_api() -> SimpleNamespace:
    """The `api` argument of beamtrt.build.drafter_net.DFlash2Network."""
    return SimpleNamespace(
        F=F, Module=Module, default_trtnet=lambda: None, torch_to_numpy=lambda t: t,
        plugins=SimpleNamespace(add_windowed_attention=_attention, add_block_selector=_selector),
        trt=SimpleNamespace(int32=torch.int32, float32=torch.float32, bfloat16=torch.bfloat16, float16=torch.float16))
