"""The torch backend's drafter on the plugin kernels (ring attention + block selector) decodes exactly as on the
PyTorch reference: on the CPU through the kernels' host build (BEAMTRT_KERNELS=host), the same math the CUDA build
runs; on a GPU (gpu-marked) through the CUDA build, the default there."""

from __future__ import annotations

import copy
from dataclasses import fields, replace

import pytest
import torch

from beamtrt.native.kernels import CudaKernels, HostKernels, kernels_for
from beamtrt.runtime.backend import DraftStep
from beamtrt.runtime.torch_backend import TorchDrafter, TorchTarget
from beamtrt.spec.decoder import Request, SpeculativeDecoder
from beamtrt.spec.sampling import SamplingParams
from conftest import tiny_model
from test_dflash2 import make_drafter

pytestmark = pytest.mark.usefixtures("one_thread")
KERNELS = {"host": HostKernels, "auto": CudaKernels, "off": None}  # BEAMTRT_KERNELS -> kernels, on PATHS
ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PATHS = [pytest.param("cpu", "host", id="host"),  # (device, BEAMTRT_KERNELS of the kernel path)
         pytest.param("cuda", "auto", id="cuda", marks=[pytest.mark.gpu, ON_GPU])]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=7)


def target_on(target, device: str):
    """The module's CPU target, or a copy of it on `device` (the fixture stays on the CPU)."""
    return target if device == "cpu" else copy.deepcopy(target).to(device)


def drafter_on(path: str, target, monkeypatch) -> TorchDrafter:
    monkeypatch.setenv("BEAMTRT_KERNELS", path)
    drafter = TorchDrafter(make_drafter(target, seed=3))  # W = 16: long answers wrap the ring
    assert drafter.drafter.kernels is KERNELS[path]
    return drafter


def decode(target, drafter, params: SamplingParams, seed: int = 0):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (3, 9, 14, 5)]
    dec = SpeculativeDecoder(TorchTarget(target), drafter, block_size=8, params=params, seed=seed)
    done = dec.generate([Request(tuple(p), 30) for p in prompts], concurrency=3)  # slot subsets as requests end
    return [c.output_ids for c in done], dec.metrics.summary()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("device,path", PATHS)
def test_kernel_path_decodes_like_the_reference(target, device, path, params, monkeypatch):
    target = target_on(target, device)
    reference = decode(target, drafter_on("off", target, monkeypatch), params)
    kernels = decode(target, drafter_on(path, target, monkeypatch), params)
    assert kernels == reference


@pytest.mark.parametrize("device,path", PATHS)
def test_draft_steps_agree(target, device, path, monkeypatch):
    target = target_on(target, device)
    ref, ker = drafter_on("off", target, monkeypatch), drafter_on(path, target, monkeypatch)
    g = torch.Generator().manual_seed(9)
    for d in (ref, ker):
        d.allocate(3)
        d.append_context(torch.randn(3, 20, 2 * 64, generator=torch.Generator().manual_seed(1)), torch.arange(3),
                         torch.tensor([20, 7, 0]))
    anchors, slots = torch.tensor([4, 50]), torch.tensor([2, 0])
    uniforms = torch.rand(2, 7, generator=g)
    for params in (SamplingParams(), SamplingParams(temperature=1.2, top_p=0.7)):
        a = ref.draft(anchors, 8, slots, params, None if params.greedy else uniforms)
        b = ker.draft(anchors, 8, slots, params, None if params.greedy else uniforms)
        b = DraftStep(*(None if t is None else t.cpu() for t in (getattr(b, f.name) for f in fields(b))))  # GPU's
        assert torch.equal(a.draft_ids, b.draft_ids) and torch.equal(a.cand_ids, b.cand_ids)
        assert (a.q is None) == (b.q is None)
        if a.q is not None:
            torch.testing.assert_close(a.q, b.q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)  # the draft threshold's input
        assert a.confidence.shape == (2, 7) and bool(((a.confidence > 0) & (a.confidence <= 1)).all())


def test_kernel_choice(monkeypatch, capsys):
    monkeypatch.delenv("BEAMTRT_KERNELS", raising=False)
    assert kernels_for("cpu") is None  # the PyTorch reference by default on the CPU
    if not torch.cuda.is_available():  # the CUDA build is the default on a GPU; without one: a line, then PyTorch
        assert kernels_for("cuda") is None
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "CUDA kernels are not available" in err[0]
    monkeypatch.setenv("BEAMTRT_KERNELS", "off")
    assert kernels_for("cuda") is None
    monkeypatch.setenv("BEAMTRT_KERNELS", "fast")
    with pytest.raises(Exception, match="expected auto, host or off"):
        kernels_for("cpu")


def test_the_host_build_is_made_when_chosen(monkeypatch):
    """BEAMTRT_KERNELS=host without a compiler failed at the first draft, after the answer's first token streamed."""
    from beamtrt.errors import DeviceError
    from beamtrt.native import kernels

    monkeypatch.setenv("BEAMTRT_KERNELS", "host")
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # another compiler: another cached library, which it cannot build
    kernels.host_library.cache_clear()
    try:
        with pytest.raises(DeviceError, match="host build is not available"):
            kernels_for("cpu")
    finally:
        kernels.host_library.cache_clear()


def test_a_drafter_beyond_the_kernels_arrays_keeps_the_reference(target, monkeypatch, capsys):
    """The kernels hold a slot's candidates and a head's dims in fixed arrays (64, 256): the host build overran them
    (a segmentation fault under BEAMTRT_KERNELS=host on a drafter of selector_top_k 65, which its config allows) and
    the CUDA build refused the drafter at its first draft. Now asking for them is one line, and the default path
    keeps the PyTorch reference, saying why."""
    from beamtrt.errors import DeviceError

    fits = make_drafter(target).cfg
    for wide, needle in ((replace(fits, selector_top_k=65), "selector_top_k 65 is above the kernels' 64"),
                         (replace(fits, head_dim=320), "head_dim 320 is above the kernels' 256")):
        monkeypatch.setenv("BEAMTRT_KERNELS", "host")
        assert kernels_for("cpu", fits) is HostKernels
        with pytest.raises(DeviceError, match=f"^BEAMTRT_KERNELS=host: the drafter does not fit .*{needle}"):
            kernels_for("cpu", wide)
        monkeypatch.delenv("BEAMTRT_KERNELS")
        assert kernels_for("cuda", wide) is None  # before the CUDA build is tried: none here to try
        assert f"the drafter does not fit the CUDA kernels ({'its ' + needle}" in capsys.readouterr().err
