"""The host kernels (beamtrt.native): the fused CPU step equals the PyTorch path, and a row's result does not depend
on how many rows share the call (a verified block gets bit-for-bit the logits of single-token steps); the fused
drafter block and context append equal the PyTorch drafter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from beamtrt import native
from beamtrt.config import DrafterConfig
from beamtrt.errors import DeviceError
from beamtrt.models.beam import right_padded
from beamtrt.models.dflash2 import random_drafter
from conftest import TINY, tiny_model

pytestmark = pytest.mark.skipif(not native.available(), reason="the host kernels cannot be built here")

CASES = {  # each covers what the others do not
    "tiny": TINY,  # QK-norm, a dense layer 0, renormalized top-2
    "bias-notnorm-tied-cap": dataclasses.replace(TINY, use_qk_norm=False, attention_bias=True, norm_topk_prob=False,
                                                 tie_word_embeddings=True, final_logit_softcapping=3.0,
                                                 logit_scale=0.5),
    "qkvbias-top3-odd-widths": dataclasses.replace(TINY, hidden_size=60, head_dim=10, qkv_bias=True, use_qk_norm=False,
                                                   num_experts=5, num_experts_per_tok=3, moe_intermediate_size=37,
                                                   intermediate_size=45, mlp_only_layers=(1,)),
    "mqa-top1-sparse2": dataclasses.replace(TINY, num_key_value_heads=1, num_experts_per_tok=1, decoder_sparse_step=2,
                                            mlp_only_layers=()),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run_steps(model, monkeypatch, path: str) -> list[torch.Tensor]:
    """A ragged prefill, single-token steps on all slots, and a verify-style block on a subset of slots."""
    monkeypatch.setenv("BEAMTRT_NATIVE", "1" if path == "native" else "0")
    g = torch.Generator().manual_seed(5)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 3, 1)]
    ids, lengths = right_padded(prompts)
    cache = model.new_cache(3, 32)
    out = model(ids, cache, num_tokens=lengths, last_only=True, taps=(0, 2))
    live = (torch.arange(ids.shape[1]) < lengths[:, None])[..., None]  # [3, 5, 1]: the padding's rows are meaningless
    results = [out.logits, *(t * live for t in out.taps)]
    for _ in range(3):
        out = model(torch.randint(0, vocab, (3, 1), generator=g), cache, taps=(1,))
        results += [out.logits, *out.taps]
    block, counts = torch.randint(0, vocab, (2, 4), generator=g), torch.tensor([4, 2])
    out = model(block, cache, num_tokens=counts, slots=torch.tensor([2, 0]), taps=(2,))
    live = (torch.arange(4) < counts[:, None])[..., None]  # [2, 4, 1]: the padding's rows are meaningless
    kept = (torch.arange(cache.max_len) < cache.lengths[:, None])[None, :, None, :, None]  # [1, B, 1, len, 1]
    results += [out.logits * live, *(t * live for t in out.taps), cache.k * kept, cache.v * kept, cache.lengths]
    return results


@pytest.mark.parametrize("case", CASES)
def test_native_step_equals_pytorch_fp32(case, monkeypatch):
    model = tiny_model(CASES[case])
    torch_path, native_path = run_steps(model, monkeypatch, "torch"), run_steps(model, monkeypatch, "native")
    for got, want in zip(native_path, torch_path):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel(got, want) < 1e-5


def test_native_step_bf16_close_to_pytorch(monkeypatch):
    model = tiny_model(dtype=torch.bfloat16)  # activations stay fp32 on the native path: bf16-rounding differences
    for got, want in zip(run_steps(model, monkeypatch, "native"), run_steps(model, monkeypatch, "torch")):
        assert got.dtype == want.dtype and rel(got, want) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verified_block_is_bit_identical_to_single_steps(dtype):
    model = tiny_model(CASES["qkvbias-top3-odd-widths"], dtype=dtype)
    g = torch.Generator().manual_seed(6)
    prompt, block = torch.randint(0, 101, (1, 6), generator=g), torch.randint(0, 101, (1, 8), generator=g)
    one, many = model.new_cache(1, 32), model.new_cache(1, 32)
    model(prompt, one), model(prompt, many)
    steps = torch.cat([model(block[:, t:t + 1], one, taps=(1,)).logits for t in range(8)], dim=1)
    assert torch.equal(model(block, many).logits, steps)
    assert torch.equal(one.k, many.k) and torch.equal(one.v, many.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_matmul_and_is_row_invariant(dtype):
    g = torch.Generator().manual_seed(7)
    for n, k in ((37, 64), (5, 61), (130, 8), (3, 3)):
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(native.MAX_ROWS + 1, k, generator=g)
        full = native.gemm(x, w)
        assert rel(full, x @ w.float().T) < 1e-6
        for m in range(1, native.MAX_ROWS + 1):  # every blocking of the rows gives the same bits
            assert torch.equal(native.gemm(x[:m], w), full[:m])
    with pytest.raises(ValueError, match="CPU tensors, got one on meta"):  # never a device address to the host
        native.gemm(x, w.to("meta"))


def test_hooks_shards_and_the_switch_take_the_pytorch_path(monkeypatch):
    model = tiny_model()
    cache = model.new_cache(1, 8)
    assert native.usable(model, cache, 1) and native.usable(model, cache, native.MAX_ROWS)  # decode, verify
    assert not native.usable(model, cache, native.MAX_ROWS + 1)  # prefill-sized inputs stay with PyTorch
    monkeypatch.setenv("BEAMTRT_NATIVE", "0")
    assert not native.usable(model, cache, 1)
    monkeypatch.setenv("BEAMTRT_NATIVE", "off")  # neither 0 nor 1: said, not taken as on
    with pytest.raises(DeviceError, match="BEAMTRT_NATIVE=off: expected 0"):
        native.usable(model, cache, 1)
    monkeypatch.delenv("BEAMTRT_NATIVE")
    model.layers[1].attn.qkv_in = lambda x: x  # emulated quantization / calibration observers need every op
    assert not native.usable(model, cache, 1)


def test_out_of_range_ids_are_refused():
    model = tiny_model()
    with pytest.raises(IndexError, match=r"\[0, 101\)"):
        model(torch.tensor([[101]]), model.new_cache(1, 8))


def test_out_of_range_slots_are_refused(monkeypatch):
    """The fused step and drafter index raw memory with a cache slot: -1 (the last slot to torch) wrote the K/V
    before the buffer (a glibc abort a step later), and the drafter read another ring."""
    monkeypatch.setenv("BEAMTRT_NATIVE", "1")
    model, drafter = tiny_model(), tiny_drafter()
    for slot, why in ((-1, r"cache slots must be in \[0, 3\), got \[-1\]"), (3, "out of bounds")):  # 3: torch's
        with pytest.raises(IndexError, match=why):
            model(torch.tensor([[5, 6]]), model.new_cache(3, 16), slots=torch.tensor([slot]))
        with pytest.raises(IndexError, match=why):
            drafter.draft(drafter.new_cache(3), torch.tensor([7]), 4, slots=torch.tensor([slot]))


def test_a_failed_build_falls_back_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BEAMTRT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    assert native.library.__wrapped__() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "building the host kernels failed" in err[0]
    assert not any(tmp_path.rglob("*.so"))  # nothing half-written left behind


def test_cxx_is_a_command_line_and_a_failed_build_names_the_error(tmp_path, monkeypatch, capsys):
    """CXX="ccache g++" (README: CXX names another compiler) was run as one file name and failed; a failed build said
    the compiler's first line, "In file included from ...", not its error."""
    monkeypatch.setenv("BEAMTRT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "env g++")  # a wrapper, as ccache is
    assert native.library.__wrapped__() is not None
    monkeypatch.setenv("CXX", "sh -c 'echo In file included from beam_step.cpp:6: >&2; echo host_math.h:45: error: "
                              "no convertvector >&2; exit 1' cc")
    assert native.library.__wrapped__() is None
    assert capsys.readouterr().err.splitlines()[-1] == (
        "beamtrt: building the host kernels failed (host_math.h:45: error: no convertvector); not used")
    monkeypatch.setenv("CXX", "g++ 'unclosed")
    assert native.library.__wrapped__() is None
    assert "is no command line (No closing quotation)" in capsys.readouterr().err


def test_the_cache_key_tells_arm_cpus_apart(monkeypatch):
    """A cache shared between hosts (a network home) handed one aarch64 CPU's -march=native library to another: their
    /proc/cpuinfo has no "model name" or "flags", the only lines the key read."""
    def cpu(part: str, features: str) -> str:
        monkeypatch.setattr(native, "Path", lambda _: type("Info", (), {"read_text": lambda self: (
            f"processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
            f"CPU part\t: {part}\n")})())
        return native.host_cpu.__wrapped__()

    assert cpu("0xd4f", "fp asimd sve sve2") != cpu("0xd0c", "fp asimd")  # Neoverse V2 (Grace), N1 (Graviton2)


def test_an_edited_header_rebuilds_the_library(tmp_path, monkeypatch):
    """The build is cached by content, headers included: editing a kernel header must not reuse a stale library."""
    monkeypatch.setenv("BEAMTRT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "value.h").write_text("#pragma once\nconstexpr int kValue = 1;\n")
    source = tmp_path / "lib.cpp"
    source.write_text('#include "inc/value.h"\nextern "C" int value() { return kValue; }\n')
    assert native.local_sources(source) == [source.resolve(), (tmp_path / "inc" / "value.h").resolve()]
    flags = ("-O1", "-shared", "-fPIC")
    assert native.compile_library(source, flags, "test").value() == 1
    (tmp_path / "inc" / "value.h").write_text("#pragma once\nconstexpr int kValue = 2;\n")
    assert native.compile_library(source, flags, "test").value() == 2
    assert len(list((tmp_path / "cache").rglob("*.so"))) == 2


def test_a_damaged_cached_library_is_built_again(tmp_path, monkeypatch):
    """A cached library that is not the file its build wrote (truncated, overwritten) is rebuilt, not loaded: a
    truncated ELF would kill the process with a bus error. The host CPU is part of the cache key (-march=native)."""
    monkeypatch.setenv("BEAMTRT_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "lib3.cpp"
    source.write_text('extern "C" int value() { return 3; }\n')
    flags = ("-O1", "-shared", "-fPIC")
    assert native.compile_library(source, flags, "test").value() == 3
    [built] = (tmp_path / "cache").rglob("*.so")
    good = built.read_bytes()
    built.unlink()  # a new file in its place: this process has the old one mapped (cutting it in place would be a
    built.write_bytes(good[:len(good) // 2])  # bus error here, the very crash the check prevents)
    assert not native._intact(built)
    native.compile_library(source, flags, "test")  # the same sources and flags: the same cache entry
    assert native._intact(built) and built.read_bytes() == good
    assert "flags" in native.host_cpu() or native.host_cpu().strip()


def test_lm_head_keeps_gradients_on_a_few_rows():
    """A few rows outside autograd take the host GEMM (fp32 logits, bit-identical to native.gemm); rows that need
    gradients (a small training batch through the full head) keep PyTorch's graph."""
    model = tiny_model()
    z = torch.randn(2, 3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = model.lm_logits(z)
    assert torch.equal(fast, native.gemm(z.reshape(6, -1), model.head_weight).view(2, 3, -1))
    z.requires_grad_(True)
    logits = model.lm_logits(z)
    logits.square().sum().backward()  # the host GEMM keeps no graph: this raised before lm_logits checked for it
    assert torch.allclose(logits.detach(), fast, atol=1e-5)
    zr = z.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(zr, model.head_weight).square().sum().backward()
    assert torch.allclose(z.grad, zr.grad, atol=1e-5)


# ---- the drafter (draft_step.cpp) ------------------------------------------------------------------------------

def tiny_drafter(dtype: torch.dtype = torch.float32, **changes):
    kw = dict(num_hidden_layers=2, target_layer_ids=(0, 2), head_dim=16, conv_group_size=16, selector_rank=8,
              selector_top_k=4, sliding_window=16, block_size=8)
    cfg = DrafterConfig.for_target(TINY, **{**kw, **changes})
    return random_drafter(cfg, tiny_model(dtype=dtype), seed=2, dtype=dtype, std=0.1, conv_std=0.05,
                          codebook_std=0.5)


def run_drafter(drafter, monkeypatch, path: str) -> list[torch.Tensor]:
    """Ragged appends that wrap the ring (W = 16), then blocks of 2 and 8 on every slot and on a subset."""
    monkeypatch.setenv("BEAMTRT_NATIVE", "1" if path == "native" else "0")
    g = torch.Generator().manual_seed(11)
    cache = drafter.new_cache(3)
    results = []
    for sizes in ([9, 0, 3], [12, 5, 1], [1, 2, 0]):  # final context lengths 22 (> W), 7, 4
        drafter.append_context(cache, torch.randn(3, max(sizes), drafter.fc.in_features, generator=g),
                               torch.tensor(sizes))
        anchors = torch.randint(0, TINY.vocab_size, (3,), generator=g)
        for block, slots in ((2, None), (8, None), (8, torch.tensor([2, 0]))):
            out = drafter.draft(cache, anchors if slots is None else anchors[slots], block, slots=slots)
            results += [out.logits, out.hidden, out.scores, out.cand_ids]
    return results + [cache.k, cache.v, cache.lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_drafter_equals_pytorch(dtype, monkeypatch):
    drafter = tiny_drafter(dtype)
    got, want = run_drafter(drafter, monkeypatch, "native"), run_drafter(drafter, monkeypatch, "torch")
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        if dtype == torch.float32:
            assert rel(a, b) < 1e-5 if a.is_floating_point() else torch.equal(a, b)  # candidates, lengths exact
        elif i >= len(got) - 3 or i % 4 < 2:  # bf16 (activations stay fp32 on the native path): logits, hidden and
            assert rel(a, b) < 3e-2          # the ring; near-tied candidates may differ, and their scores with them


def test_native_drafter_of_a_head_width_off_the_vector_width_equals_pytorch(monkeypatch):
    """head_dim 10, not a multiple of 8: the attention's scalar tail (a lane off there survived the test above)."""
    drafter = tiny_drafter(head_dim=10)
    got, want = run_drafter(drafter, monkeypatch, "native"), run_drafter(drafter, monkeypatch, "torch")
    assert all(rel(a, b) < 1e-5 if a.is_floating_point() else torch.equal(a, b) for a, b in zip(got, want))


def test_native_drafter_without_convs_equals_pytorch(monkeypatch):
    """use_conv = False (a DFlash v1 forward) skips the convs on both paths."""
    drafter = tiny_drafter()
    drafter.use_conv = False
    got, want = run_drafter(drafter, monkeypatch, "native"), run_drafter(drafter, monkeypatch, "torch")
    assert all(rel(a, b) < 1e-5 for a, b in zip(got, want) if a.is_floating_point())
    drafter.use_conv = True
    assert rel(run_drafter(drafter, monkeypatch, "native")[0], got[0]) > 1e-3  # the convs do change the drafts


def test_drafter_hooks_shards_and_the_switch_take_the_pytorch_path(monkeypatch):
    drafter = tiny_drafter()
    cache = drafter.new_cache(2)
    assert native.draft_usable(drafter, cache)
    monkeypatch.setenv("BEAMTRT_NATIVE", "0")
    assert not native.draft_usable(drafter, cache)
    monkeypatch.delenv("BEAMTRT_NATIVE")
    drafter.kernels = object()  # the plugin kernels' path (BEAMTRT_KERNELS=host) keeps the PyTorch layers
    assert not native.draft_usable(drafter, cache)
    drafter.kernels = None
    drafter.layers[0].mlp.reduce = lambda x: x  # tensor parallel, or emulated quantization hooks
    assert not native.draft_usable(drafter, cache)
