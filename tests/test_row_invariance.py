"""A row's logits and K/V do not depend on the other rows of its forward, on every CPU path: a verified block gets
bit for bit what single-token steps would, alone or batched, and a prompt's prefill what it gets alone. Lossless greedy
speculative decoding rests on this."""

from __future__ import annotations

import copy
import dataclasses
from functools import partial

import pytest
import torch

from beamtrt import native
from beamtrt.checkpoint.trtllm_files import act_hooks
from beamtrt.models.beam import right_padded
from beamtrt.quant import fp8, nvfp4
from conftest import TINY, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SHARED = dataclasses.replace(TINY, shared_expert_intermediate_size=48, norm_topk_prob=False, qkv_bias=True)
CAPPED = dataclasses.replace(TINY, final_logit_softcapping=3.0, logit_scale=0.5, attention_bias=True)


def emulate_nvfp4(model) -> None:
    """NVFP4 activations at every GEMM input and an FP8 KV cache, as install_emulation sets them from a checkpoint
    (amax 4 everywhere, so that the FP4 grid is coarse for these activations)."""
    for site, (module, attr) in act_hooks(model).items():
        fake = (partial(fp8.fake_quant, scale=4 / 448) if site.endswith("_cache") else
                partial(nvfp4.fake_quant_activation, scale_2=nvfp4.global_scale(torch.tensor(4.0))))
        setattr(module, attr, fake)


PATHS = {  # name -> (config, NVFP4 emulation, host kernels on)
    "fused host step": (TINY, False, True),
    "fused host step, soft-capped logits": (CAPPED, False, True),
    "eager, NVFP4 hooks, host GEMM": (TINY, True, True),
    "eager, NVFP4 hooks, per-row products": (TINY, True, False),
    "eager, shared expert, host GEMM": (SHARED, False, True),
    "eager, shared expert, NVFP4 hooks, per-row products": (SHARED, True, False),
    "eager, soft-capped logits, NVFP4 hooks, host GEMM": (CAPPED, True, True),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_in_any_forward(path, dtype, monkeypatch):
    cfg, quantized, host = PATHS[path]
    if host and not native.available():
        pytest.skip("the host kernels cannot be built here")
    monkeypatch.setenv("BEAMTRT_NATIVE", "1" if host else "0")
    model = tiny_model(cfg, seed=2, dtype=dtype)
    if quantized:
        emulate_nvfp4(model)
    assert native.usable(model, model.new_cache(1, 4), 8) == path.startswith("fused host step")
    g = torch.Generator().manual_seed(3)
    ids, lengths = right_padded([torch.randint(0, 101, (n,), generator=g).tolist() for n in (21, 5, 13)])
    cache = model.new_cache(3, 48)
    model(ids, cache, num_tokens=lengths)  # a prefill-shaped forward (PyTorch's GEMMs): shared by every way below
    block = torch.randint(0, 101, (3, 8), generator=g)

    def run(rows: list[int], tokens_per_call: int):
        """Feed `block`'s rows for slots `rows`, `tokens_per_call` tokens at a time: (logits [B, 8, V], cache)."""
        c = copy.deepcopy(cache)
        slots = torch.tensor(rows)
        logits = [model(block[slots, t:t + tokens_per_call], c, slots=slots).logits
                  for t in range(0, 8, tokens_per_call)]
        return torch.cat(logits, dim=1), c

    steps, step_cache = run([0, 1, 2], 1)  # plain decoding of three sequences
    verify, verify_cache = run([0, 1, 2], 8)  # one verify pass over all three
    alone, alone_cache = run([1], 8)  # slot 1's block verified alone
    assert torch.equal(verify, steps) and torch.equal(alone[0], steps[1])
    for c in (verify_cache, alone_cache):
        assert torch.equal(c.k[:, 1], step_cache.k[:, 1]) and torch.equal(c.v[:, 1], step_cache.v[:, 1])
    # a ragged verify (the draft threshold's: fewer tokens for some slots, padded to one rectangle): the live rows
    # get the same bits, K/V and taps; the fused path skips the padding
    ragged_cache, counts = copy.deepcopy(cache), torch.tensor([8, 3, 5])
    ragged = model(block, ragged_cache, num_tokens=counts, taps=(0, 1))
    full = model(block, copy.deepcopy(cache), taps=(0, 1))
    assert torch.equal(ragged_cache.lengths, cache.lengths + counts)
    for b, n in enumerate(counts.tolist()):
        end = int(ragged_cache.lengths[b])
        assert torch.equal(ragged.logits[b, :n], steps[b, :n])
        assert all(torch.equal(r[b, :n], f[b, :n]) for r, f in zip(ragged.taps, full.taps))
        for got, want in ((ragged_cache.k, step_cache.k), (ragged_cache.v, step_cache.v)):
            assert torch.equal(got[:, b, :, :end], want[:, b, :, :end])
    # a prompt wider than those shapes (a prefill) gets the same bits alone and batched with longer or shorter ones
    prompt = ids[0].tolist()

    def prefill(neighbours: list[int]):
        c = model.new_cache(1 + len(neighbours), 48)
        rows, counts = right_padded([prompt, *[torch.randint(0, 101, (n,), generator=g).tolist() for n in neighbours]])
        out = model(rows, c, num_tokens=counts, taps=(0, 1), last_only=True)
        return [out.logits[0], *(t[0, :21] for t in out.taps), c.k[:, 0, :, :21], c.v[:, 0, :, :21]]
    alone = prefill([])
    for neighbours in ([40], [17, 3], [30, 44, 2]):
        assert all(torch.equal(a, b) for a, b in zip(prefill(neighbours), alone))
    if quantized:  # the hooks ran: the same forward without them differs
        for module, attr in act_hooks(model).values():
            setattr(module, attr, None)
        assert not torch.equal(run([0, 1, 2], 8)[0], verify)


def test_prefill_shapes_keep_pytorchs_gemms():
    """Only decode and verify shapes pay for row invariance; longer inputs take the batched path (one row at a time
    when there are several)."""
    model = tiny_model()
    start = torch.zeros(2, dtype=torch.long)
    assert model.step_layout(start, native.MAX_ROWS).invariant
    long = model.step_layout(start, native.MAX_ROWS + 1)
    assert not long.invariant and long.mask is not None
