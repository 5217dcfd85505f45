"""beamtrt.quant (NVFP4, FP8) against nvidia-modelopt 0.47, bit for bit, on CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from beamtrt.quant import fp8, nvfp4

with warnings.catch_warnings():  # modelopt's import emits torch.jit deprecation warnings
    warnings.simplefilter("ignore")
    pytest.importorskip("modelopt")
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

from modelopt_ref import quant_config, quantize_and_export, random_batches, tiny_qwen3_moe

pytestmark = pytest.mark.filterwarnings("ignore")

MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bits(ours: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    assert ours.dtype == ref.dtype, f"{what}: dtype {ours.dtype} != {ref.dtype}"
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    diff = (bits(ours) != bits(ref)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.numel()} differing bytes, first at byte {diff[0].item()}"


# ---------------------------------------------------------------------------------------------
# modelopt references (CPU)


def ref_nvfp4(w: torch.Tensor, s2: torch.Tensor | None):
    """modelopt's export path for one weight: NVFP4QTensor.get_weights_scaling_factor + quantize."""
    if s2 is None:
        s2 = NVFP4QTensor.get_weights_scaling_factor_2(w)
    s2v = s2.view(-1, 1, 1) if s2.dim() else s2  # what to_quantized_weight does for stacked experts
    bs, _ = NVFP4QTensor.get_weights_scaling_factor(w, 16, s2v)
    qt, bs2, _ = NVFP4QTensor.quantize(w.clone(), 16, bs, s2v)
    assert torch.equal(bits(bs), bits(bs2))
    return qt, bs, s2


def ref_nvfp4_fake(x: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    qt, bs, _ = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=s2)
    return qt.dequantize(dtype=x.dtype, scale=bs, double_scale=s2, block_sizes={-1: 16})


def ref_fp8_fake(x: torch.Tensor, amax: float) -> torch.Tensor:
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
    q.amax = torch.tensor(amax, dtype=torch.float32)
    return q(x)


# ---------------------------------------------------------------------------------------------
# test tensors


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def on_bounds(rows: int, cols: int, seed: int) -> torch.Tensor:
    """fp32 [rows, cols] whose scaled values (with scale_2 = 1/64) sit exactly on E2M1 values and midpoints.

    Every block's max is 6/8 so its E4M3 block scale is (6/8) / (6/64) = 8 exactly and w / (8/64) = 8 w.
    """
    g = gen(seed)
    pool = torch.tensor(MIDPOINTS + E2M1 + [-v for v in MIDPOINTS + E2M1[1:]] + [0.1, 5.9, 6.0, -6.0])
    w = pool[torch.randint(0, len(pool), (rows, cols), generator=g)] / 8
    w.view(rows, cols // 16, 16)[..., 3] = 6.0 / 8
    w.view(rows, cols // 16, 16)[::2, :, 5] = -6.0 / 8
    return w


def hard_weights(seed: int) -> torch.Tensor:
    """fp32 [48, 128] with zero blocks, a zero row, tiny and huge blocks, outliers, -0.0 and subnormals."""
    g = gen(seed)
    w = torch.randn(48, 128, generator=g)
    blocks = w.view(48, 8, 16)
    blocks[0] = 0.0  # a whole zero row
    blocks[1, 2] = 0.0  # zero block
    blocks[2, :, :8] = -0.0
    blocks[3] *= 1e-30  # below everything: block scale clamps to 2^-9
    blocks[4, 1] *= 1e-6
    blocks[5, 3] = torch.tensor([1e-40, -1e-41] * 8)  # fp32 subnormals
    blocks[6, 0, 0] = 300.0  # outlier: sets the global amax
    scale_per_elem = torch.exp2(torch.randint(-24, 12, (48, 128), generator=g).float())
    w[8:16] *= scale_per_elem[8:16]  # huge dynamic range inside blocks
    w[16:24] *= torch.exp2(torch.randint(-20, 8, (8, 8, 1), generator=g).float()).repeat_interleave(16, 1).view(8, 128)
    return w


WEIGHT_CASES = {
    "randn": lambda: torch.randn(64, 128, generator=gen(0)) * 0.05,
    "on_bounds": lambda: on_bounds(32, 64, 1),
    "hard": lambda: hard_weights(2),
    "wide": lambda: torch.randn(8, 1024, generator=gen(3)) * 3,
}


# ---------------------------------------------------------------------------------------------
# NVFP4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
@pytest.mark.parametrize("explicit_scale", [False, True])
def test_nvfp4_weight_matches_modelopt(case, dtype, explicit_scale):
    w = WEIGHT_CASES[case]().to(dtype)
    if dtype == torch.float16:
        w = w.clamp(-6e4, 6e4)
    s2 = None
    if explicit_scale:
        # on_bounds is built for 1/64; others: amax-derived scale, then a too-small one (scales clamp at 448)
        s2 = torch.tensor(1 / 64) if case == "on_bounds" else nvfp4.global_scale(w.abs().amax()) / 7
    packed, bs, s2_out = nvfp4.quantize_weight(w, s2)
    qt, bs_ref, s2_ref = ref_nvfp4(w, s2)
    assert_bits(s2_out, s2_ref.float(), "weight_scale_2")
    assert_bits(bs, bs_ref, "weight_scale")
    assert_bits(packed, qt._quantized_data, "packed weight")
    for out_dtype in (torch.float32, torch.bfloat16):
        deq = nvfp4.dequantize_weight(packed, bs, s2_out, dtype=out_dtype)
        ref = qt.dequantize(dtype=out_dtype, scale=bs_ref, double_scale=s2_ref, block_sizes={-1: 16})
        assert_bits(deq, ref, "dequantized weight")


def test_nvfp4_on_bounds_round_half_even():
    # block max 6/8 and scale_2 = 1/64 give an E4M3 block scale of exactly 8, so w * 8 is what gets rounded
    w = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 5.5]])
    packed, bs, s2 = nvfp4.quantize_weight(w / 8, torch.tensor(1 / 64))
    assert bs.float().item() == 8.0
    qt, _, _ = ref_nvfp4(w / 8, torch.tensor(1 / 64))
    assert_bits(packed, qt._quantized_data)
    deq = nvfp4.dequantize_weight(packed, bs, s2) * 8
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, 6.0]
    assert deq[0].tolist() == expect
    assert packed[0, 0].item() == 0x20  # element 0 (code 0) in the low nibble, element 1 (code 2) high
    assert packed[0, 4].item() == 0xA8  # element 8: -0.25 -> code 8 ("-0"); element 9: -0.75 -> code 0xA (-1.0)


def test_nvfp4_zero_block_scale_is_one():
    w = torch.randn(4, 32, generator=gen(5))
    w[1, 16:] = 0
    _, bs, _ = nvfp4.quantize_weight(w)
    assert bs[1, 1].float().item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_stacked_experts(dtype):
    w = (torch.randn(4, 32, 64, generator=gen(6)) * torch.tensor([0.01, 1.0, 30.0, 0.2]).view(4, 1, 1)).to(dtype)
    w[2, 0, :16] = 0
    amax = w.abs().amax(dim=(1, 2)).float()
    for s2 in (None, nvfp4.global_scale(amax)):
        packed, bs, s2_out = nvfp4.quantize_weight(w, s2)
        assert s2_out.shape == (4,) and packed.shape == (4, 32, 32) and bs.shape == (4, 32, 4)
        assert_bits(s2_out, nvfp4.global_scale(amax))
        qt, bs_ref, _ = ref_nvfp4(w, s2_out)  # modelopt's stacked path: scale_2.view(-1, 1, 1)
        assert_bits(bs, bs_ref)
        assert_bits(packed, qt._quantized_data)
        for e in range(4):  # and per expert through modelopt's 2-D path
            qt_e, bs_e, _ = ref_nvfp4(w[e], s2_out[e])
            assert_bits(packed[e], qt_e._quantized_data)
            assert_bits(bs[e], bs_e)
        deq = nvfp4.dequantize_weight(packed, bs, s2_out)
        for e in range(4):
            assert_bits(deq[e], nvfp4.dequantize_weight(packed[e], bs[e], s2_out[e]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_activation_fake_quant(dtype):
    g = gen(7)
    xs = [torch.randn(3, 5, 64, generator=g) * 2, on_bounds(8, 64, 8), hard_weights(9).view(2, 24, 128)]
    for x in xs:
        x = x.to(dtype)
        amax = x.abs().amax().float()
        for s2 in (nvfp4.global_scale(amax), nvfp4.global_scale(amax / 4), nvfp4.global_scale(amax * 3),
                   torch.tensor(1 / 64)):
            out = nvfp4.fake_quant_activation(x, s2)
            assert_bits(out, ref_nvfp4_fake(x, s2), "fake-quant activation")


def test_nvfp4_rejects_bad_input():
    w = torch.randn(4, 32)
    with pytest.raises(ValueError):
        nvfp4.quantize_weight(torch.randn(4, 24))
    with pytest.raises(ValueError):
        nvfp4.quantize_weight(torch.zeros(4, 32))  # global scale would be 0
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            nvfp4.quantize_weight(w, torch.tensor(bad))
        with pytest.raises(ValueError):
            nvfp4.fake_quant_activation(w, torch.tensor(bad))
    with pytest.raises(ValueError):
        nvfp4.quantize_weight(torch.randn(3, 4, 32), torch.ones(2))
    with pytest.raises(ValueError):
        nvfp4.fake_quant_activation(torch.randn(2, 20), torch.tensor(1.0))
    packed, bs, s2 = nvfp4.quantize_weight(w)
    with pytest.raises(ValueError):
        nvfp4.dequantize_weight(packed, bs[:, :1], s2)
    with pytest.raises(ValueError):
        nvfp4.dequantize_weight(packed, bs, torch.tensor(0.0))


# ---------------------------------------------------------------------------------------------
# FP8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
def test_fp8_weight_matches_modelopt_export(case, dtype):
    w = WEIGHT_CASES[case]().to(dtype)
    if dtype == torch.float16:
        w = w.clamp(-6e4, 6e4)
    amax = w.abs().amax().float()
    scale = fp8.scale_from_amax(amax)
    assert_bits(scale, amax / 448.0, "weight_scale")
    q = fp8.quantize(w, scale)
    assert_bits(q, to_quantized_weight(w, scale, QUANTIZATION_FP8), "fp8 weight")
    assert_bits(fp8.dequantize(q, scale), q.float() * scale)


def test_fp8_stacked_equals_per_expert():
    w = (torch.randn(3, 16, 32, generator=gen(10)) * torch.tensor([0.01, 1.0, 40.0]).view(3, 1, 1)).bfloat16()
    scale = fp8.scale_from_amax(w.abs().amax(dim=(1, 2)).float())
    q = fp8.quantize(w, scale)
    for e in range(3):
        assert_bits(q[e], to_quantized_weight(w[e], scale[e], QUANTIZATION_FP8))
        assert_bits(fp8.dequantize(q, scale)[e], fp8.dequantize(q[e], scale[e]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_fake_quant_matches_modelopt(dtype):
    g = gen(11)
    xs = [torch.randn(4, 7, 64, generator=g) * 3, hard_weights(12), torch.zeros(3, 5)]
    for x in xs:
        x = x.to(dtype)
        for amax in (x.abs().amax().item(), 1.7, 0.0, 1e-30, 2.0**-24, 2.0**-23, 1e4):  # 2^-24: its "<=" bound
            assert_bits(fp8.fake_quant_from_amax(x, amax), ref_fp8_fake(x, amax), f"amax={amax}")
        # fake_quant(x, scale) multiplies by 1/scale and dequantizes with scale; modelopt uses 448/amax
        # and its reciprocal. They agree bit for bit whenever those two multipliers coincide:
        candidates = [448.0 * 2.0**k for k in (-8, -1, 0, 3)] + (torch.rand(200, generator=g) * 50 + 0.01).tolist()
        checked = 0
        for amax in candidates:
            a = torch.tensor(amax, dtype=torch.float32)
            s = fp8.scale_from_amax(a)
            if not (torch.equal(1.0 / s, 448.0 / a) and torch.equal(s, 1 / (448.0 / a))):
                continue
            checked += 1
            assert_bits(fp8.fake_quant(x, s), ref_fp8_fake(x, a.item()), f"amax={amax}")
        assert checked >= 10
        # and in general the E4M3 codes agree (checked on the dequantized fp32 values being within one code)
        s = fp8.scale_from_amax(torch.tensor(2.3))
        ours, ref = fp8.fake_quant(x.float(), s), ref_fp8_fake(x.float(), 2.3)
        torch.testing.assert_close(ours, ref, rtol=2e-7, atol=0)


def test_fp8_fake_quant_no_intermediate_rounding():
    """bf16 input: fake_quant rounds once (fp32 -> e4m3); quantize() rounds to bf16 first, like the export."""
    x = torch.randn(4096, generator=gen(13)).bfloat16()
    s = torch.tensor(0.01)
    fq = fp8.fake_quant(x, s)
    direct = (x.float() * (1.0 / s)).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(s).bfloat16()
    assert_bits(fq, direct)


def test_fp8_rejects_bad_input():
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            fp8.quantize(torch.randn(4), torch.tensor(bad))
        with pytest.raises(ValueError):
            fp8.fake_quant(torch.randn(4), bad)
    with pytest.raises(ValueError):
        fp8.quantize(torch.randn(3, 4, 4), torch.ones(2))
    with pytest.raises(ValueError):
        fp8.dequantize(torch.randn(4), torch.tensor(1.0))
    with pytest.raises(ValueError):
        fp8.fake_quant_from_amax(torch.randn(4), float("nan"))


# ---------------------------------------------------------------------------------------------
# end to end: a tiny Qwen3-MoE quantized and exported by modelopt


def _linear_groups(names: list[str]) -> dict[str, list[str]]:
    """module name -> names of the modules whose amax it shares in the NVFP4 HF export.

    modelopt 0.47 `requantize_resmooth_fused_llm_layers` fuses linears that consume the same tensor:
    q/k/v of a layer, and gate/up of each expert (plus `sync_moe_gate_up_amax` as a safety net); the
    shared weight amax and input amax are the max over the group (`preprocess_linear_fusion`).
    """
    groups = {}
    for n in names:
        head, _, leaf = n.rpartition(".")
        if leaf in ("q_proj", "k_proj", "v_proj"):
            groups[n] = [f"{head}.{p}" for p in ("q_proj", "k_proj", "v_proj")]
        elif leaf in ("gate_proj", "up_proj"):
            groups[n] = [f"{head}.{p}" for p in ("gate_proj", "up_proj")]
        else:
            groups[n] = [n]
    return groups


def _expected_linears(model) -> set[str]:
    names = set()
    for i, _ in enumerate(model.model.layers):
        names |= {f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
        names |= {f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(4)
                  for p in ("gate_proj", "up_proj", "down_proj")}
    return names


@pytest.fixture(scope="module")
def nvfp4_export(tmp_path_factory):
    model = tiny_qwen3_moe(seed=0)
    ref = quantize_and_export(model, "NVFP4_DEFAULT_CFG", random_batches(256), tmp_path_factory.mktemp("nvfp4"))
    return model, ref


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory):
    model = tiny_qwen3_moe(seed=0)
    ref = quantize_and_export(model, quant_config("FP8_DEFAULT_CFG", kv_fp8=True), random_batches(256),
                              tmp_path_factory.mktemp("fp8"))
    return model, ref


def _check_experts_share_input_amax(ref) -> None:
    # After max calibration modelopt's _QuantSparseSequentialMoe.layer_sync_moe_local_experts_amax sets every
    # expert's gate/up/down input amax to the max over the layer's experts (before export).
    for i in range(2):
        for p in ("gate_proj", "up_proj", "down_proj"):
            vals = [ref.input_amax[f"model.layers.{i}.mlp.experts.{e}.{p}"] for e in range(4)]
            assert all(torch.equal(v, vals[0]) for v in vals)


def test_e2e_nvfp4_export(nvfp4_export):
    model, ref = nvfp4_export
    T = ref.tensors
    assert ref.hf_quant_config["quantization"]["quant_algo"] == "NVFP4"
    names = sorted(ref.weight_amax)
    assert set(names) == _expected_linears(model)
    _check_experts_share_input_amax(ref)
    groups = _linear_groups(names)
    for n in names:
        w = ref.original[n + ".weight"]
        # the weight quantizer's amax is max|W| of that module (max calibration on the weight itself)
        assert_bits(ref.weight_amax[n], w.abs().amax().float(), f"{n} weight amax")
        w_amax = torch.stack([ref.weight_amax[m] for m in groups[n]]).max()
        in_amax = torch.stack([ref.input_amax[m] for m in groups[n]]).max()
        packed, bs, s2 = nvfp4.quantize_weight(w, nvfp4.global_scale(w_amax))
        assert_bits(packed, T[n + ".weight"], f"{n}.weight")
        assert_bits(bs, T[n + ".weight_scale"], f"{n}.weight_scale")
        assert_bits(s2, T[n + ".weight_scale_2"], f"{n}.weight_scale_2")
        assert_bits(nvfp4.global_scale(in_amax), T[n + ".input_scale"], f"{n}.input_scale")
    # the shared scales really differ from per-module ones somewhere (so the grouping is exercised)
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    assert not torch.equal(ref.weight_amax[q], ref.weight_amax[k])
    assert torch.equal(T[q + ".weight_scale_2"], T[k + ".weight_scale_2"])
    # router, norms, embeddings and lm_head stay bf16
    assert T["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert T["lm_head.weight"].dtype == torch.bfloat16


def test_e2e_fp8_export(fp8_export):
    model, ref = fp8_export
    T = ref.tensors
    assert ref.hf_quant_config["quantization"]["quant_algo"] == "FP8"
    assert ref.hf_quant_config["quantization"]["kv_cache_quant_algo"] == "FP8"
    names = sorted(ref.weight_amax)
    assert set(names) == _expected_linears(model)
    _check_experts_share_input_amax(ref)
    for n in names:
        w = ref.original[n + ".weight"]
        assert_bits(ref.weight_amax[n], w.abs().amax().float(), f"{n} weight amax")
        # FP8 HF export does NOT fuse q/k/v (_fuse_shared_input_modules skips FP8): each keeps its own
        # weight_scale; expert gate/up still share max(amax) via sync_moe_gate_up_amax.
        group = [n] if "self_attn" in n else _linear_groups([n])[n]
        w_amax = torch.stack([ref.weight_amax[m] for m in group]).max()
        in_amax = torch.stack([ref.input_amax[m] for m in group]).max()
        scale = fp8.scale_from_amax(w_amax)
        assert_bits(scale, T[n + ".weight_scale"], f"{n}.weight_scale")
        assert_bits(fp8.quantize(w, scale), T[n + ".weight"], f"{n}.weight")
        assert_bits(fp8.scale_from_amax(in_amax), T[n + ".input_scale"], f"{n}.input_scale")
    # KV cache: k_scale / v_scale = amax of k (after k_norm and RoPE) / v fed to attention, / 448, no clamp
    for i in range(2):
        for kv in ("k", "v"):
            amax = ref.kv_amax[f"model.layers.{i}.self_attn.{kv}_bmm_quantizer"]
            assert_bits(fp8.scale_from_amax(amax), T[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"])
