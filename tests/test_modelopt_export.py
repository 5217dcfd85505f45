"""Our TensorRT-LLM checkpoints against nvidia-modelopt's own TensorRT-LLM export of the same weights and ranges:
every tensor modelopt writes, we write with the same name, shape, dtype and bytes (TP 2, FP8 + FP8 KV, NVFP4)."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file

from beamtrt.checkpoint import trtllm
from beamtrt.config import BeamConfig

pytest.importorskip("modelopt")
pytestmark = pytest.mark.usefixtures("one_thread")


def _quantize_and_export_trtllm(model, cfg_name: str, tp: int, out):
    """modelopt: max-calibrate, record input / KV ranges, export a TensorRT-LLM checkpoint (legacy path)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_tensorrt_llm_checkpoint
    from modelopt.torch.quantization.nn import TensorQuantizer

    from modelopt_ref import quant_config, random_batches

    cfg = quant_config(cfg_name, kv_fp8=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, lambda m: [m(ids) for ids in random_batches(model.config.vocab_size)])
        amax = {name: mod.amax.detach().float().clone() for name, mod in model.named_modules()
                if isinstance(mod, TensorQuantizer) and mod.is_enabled and mod.amax is not None}
        export_tensorrt_llm_checkpoint(model, "qwen", torch.bfloat16, export_dir=str(out),
                                       inference_tensor_parallel=tp)
    return amax, [load_file(str(out / f"rank{r}.safetensors")) for r in range(tp)]


def _our_ranges(cfg: BeamConfig, amax: dict[str, torch.Tensor]) -> dict[str, float]:
    """modelopt's per-module input ranges -> our calibration sites (a fused GEMM takes the max over its members)."""
    def top(*names: str) -> float:
        return max(float(amax[n + ".input_quantizer"].max()) for n in names)

    out: dict[str, float] = {}
    for i in range(cfg.num_hidden_layers):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        out[trt + "attention.qkv"] = top(*(hf + f"self_attn.{p}_proj" for p in "qkv"))
        out[trt + "attention.dense"] = top(hf + "self_attn.o_proj")
        for kind in "kv":
            if hf + f"self_attn.{kind}_bmm_quantizer" in amax:
                out[trt + f"attention.{kind}_cache"] = float(amax[hf + f"self_attn.{kind}_bmm_quantizer"])
        if cfg.is_moe_layer(i):
            experts = [hf + f"mlp.experts.{e}." for e in range(cfg.num_experts)]
            out[trt + "mlp.fc"] = top(*(e + p for e in experts for p in ("gate_proj", "up_proj")))
            out[trt + "mlp.proj"] = top(*(e + "down_proj" for e in experts))
        else:
            out[trt + "mlp.fc"] = top(hf + "mlp.gate_proj", hf + "mlp.up_proj")
            out[trt + "mlp.proj"] = top(hf + "mlp.down_proj")
    return out


@pytest.mark.parametrize("precision, cfg_name, tp, zero", [
    ("fp8", "FP8_DEFAULT_CFG", 2, False), ("nvfp4", "NVFP4_DEFAULT_CFG", 2, False),
    ("nvfp4", "NVFP4_DEFAULT_CFG", 4, False), ("fp8", "FP8_DEFAULT_CFG", 2, True)])
def test_rank_files_equal_modelopt_export(tmp_path, precision, cfg_name, tp, zero):
    """zero: an expert's down_proj is all zeros (a pruned expert); its scale is modelopt's too, 1.0 (modelopt's NVFP4
    export writes NaN block scales for it: tests/test_trtllm.py checks ours); and a dense layer's gate_proj, so that
    calibration never sees its down_proj's input non-zero: that input's scale is modelopt's too."""
    from modelopt_ref import tiny_qwen3_moe

    model = tiny_qwen3_moe(seed=3, mlp_only_layers=[1], moe_intermediate_size=64)  # NVFP4 at TP 4: 16 per rank
    if zero:
        model.model.layers[0].mlp.experts[1].down_proj.weight.data.zero_()
        model.model.layers[1].mlp.gate_proj.weight.data.zero_()
    source = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = BeamConfig.from_dict(model.config.to_dict())
    amax, theirs = _quantize_and_export_trtllm(model, cfg_name, tp, tmp_path)

    mapping = trtllm.Mapping(tp)
    units = trtllm.target_units(cfg, mapping)
    ranges = _our_ranges(cfg, amax)
    assert (ranges["transformer.layers.1.mlp.proj"] == 0) == zero
    ours: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    specs = trtllm.unit_specs(units, precision, torch.bfloat16, "fp8", cfg.num_hidden_layers)
    for r, name, t, slot in trtllm.produce(units, source.__getitem__, mapping, precision, torch.bfloat16, ranges):
        if slot is None:
            ours[r][name] = t
        else:
            ours[r].setdefault(name, torch.zeros(specs[name][0], dtype=specs[name][1]))[slot] = t
    for name, t in trtllm.kv_cache_scales(cfg.num_hidden_layers, ranges):
        for r in range(tp):
            ours[r][name] = t

    for r in range(tp):
        assert set(theirs[r]) == set(ours[r]), (set(theirs[r]) ^ set(ours[r]))
        for name, ref in theirs[r].items():
            got = ours[r][name]
            assert got.shape == ref.shape and got.dtype == ref.dtype, (name, got.shape, got.dtype, ref.shape, ref.dtype)
            assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name


# ---- emulation: the reference model run from our checkpoint == the reference model under modelopt's numerics ----

def _our_checkpoint(tmp_path, cfg: BeamConfig, source: dict, precision: str, ranges: dict, tp: int = 2):
    from beamtrt.checkpoint.trtllm_files import load_target, write_checkpoint

    mapping = trtllm.Mapping(tp)
    units = trtllm.target_units(cfg, mapping)
    specs = trtllm.unit_specs(units, precision, torch.bfloat16)
    items = trtllm.produce(units, source.__getitem__, mapping, precision, torch.bfloat16, ranges)
    write_checkpoint(tmp_path, trtllm.target_config(cfg, mapping, precision, "auto", torch.bfloat16), specs, tp, items)
    return load_target(tmp_path)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, model.new_cache(ids.shape[0], ids.shape[1])).logits


def _reference_with(model, ranges: dict, weight_fq, act_fq) -> None:
    """Apply fake quantization to our reference model: each fused weight group through weight_fq(w, group amax),
    each quantized GEMM input through act_fq(x, its range)."""
    from beamtrt.checkpoint.trtllm_files import act_hooks

    with torch.no_grad():
        for layer in model.layers:
            attn = layer.attn if hasattr(layer, "attn") else layer.self_attn  # target / drafter
            attn.qkv.weight.data = weight_fq(attn.qkv.weight.data, attn.qkv.weight.abs().amax())
            attn.o_proj.weight.data = weight_fq(attn.o_proj.weight.data, attn.o_proj.weight.abs().amax())
            mlp = layer.mlp
            if hasattr(mlp, "w_gate_up"):
                for e in range(mlp.w_gate_up.shape[0]):
                    mlp.w_gate_up.data[e] = weight_fq(mlp.w_gate_up[e], mlp.w_gate_up[e].abs().amax())
                    mlp.w_down.data[e] = weight_fq(mlp.w_down[e], mlp.w_down[e].abs().amax())
            else:
                mlp.gate_up.weight.data = weight_fq(mlp.gate_up.weight.data, mlp.gate_up.weight.abs().amax())
                mlp.down.weight.data = weight_fq(mlp.down.weight.data, mlp.down.weight.abs().amax())
    for site, (module, attr) in act_hooks(model).items():
        if site in ranges:
            setattr(module, attr, lambda x, a=ranges[site]: act_fq(x, a))


def _random_ranges(cfg: BeamConfig, seed: int, fp8_exact: bool = False) -> dict[str, float]:
    """Activation ranges in [1.75, 7]; with fp8_exact, 448·2^-k only, so that modelopt's multipliers (448/amax,
    amax/448) and TensorRT-LLM's (1/scale, scale) are the same powers of two."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(cfg.num_hidden_layers):
        for site in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj"):
            u = float(torch.rand((), generator=gen))
            out[f"transformer.layers.{i}.{site}"] = 448 * 2.0 ** -(6 + int(u * 3)) if fp8_exact else 1.75 + 5.25 * u
    return out


def test_nvfp4_emulation_equals_modelopt_numerics_bit_for_bit(tmp_path):
    """modelopt's NVFP4 fake-quant forward needs CUDA; so the reference applies modelopt's NVFP4QTensor to our
    reference model's weights (group global scales) and GEMM inputs (calibrated global scales). Same graph, so
    the logits must be identical."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    from beamtrt.models.beam import BeamForCausalLM, load_state

    def fake(x, s2):
        qt, bs, _ = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=s2)
        return qt.dequantize(dtype=x.dtype, scale=bs, double_scale=s2, block_sizes={-1: 16})

    from modelopt_ref import tiny_qwen3_moe
    hf = tiny_qwen3_moe(seed=5, mlp_only_layers=[1])
    cfg = BeamConfig.from_dict(hf.config.to_dict())
    source = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    ranges = _random_ranges(cfg, 0)
    ref = BeamForCausalLM(cfg)
    load_state(ref, source.items())
    _reference_with(ref, ranges, lambda w, amax: fake(w, amax.float() / (6 * 448)),
                    lambda x, a: fake(x, torch.tensor(a, dtype=torch.float32) / (6 * 448)))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = _logits(_our_checkpoint(tmp_path, cfg, source, "nvfp4", ranges), ids)
    assert torch.equal(ours, _logits(ref.eval(), ids))


def test_fp8_emulation_equals_modelopt_numerics(tmp_path):
    """FP8 with modelopt's own fake quantizer (TensorQuantizer E4M3 with amax) on our reference model."""
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    from beamtrt.models.beam import BeamForCausalLM, load_state

    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import to_quantized_weight

    def fake(x, amax):
        q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
        q.amax = torch.as_tensor(amax, dtype=torch.float32)
        return q(x)

    def exported(w, amax):  # modelopt's fake quant multiplies by 448/amax, which rounds exact ties (common in bf16
        scale = (amax.float() / 448).reshape(1)  # weights) differently from its export's w / scale: we follow export
        return to_quantized_weight(w, scale, QUANTIZATION_FP8).float() * scale

    from modelopt_ref import tiny_qwen3_moe
    hf = tiny_qwen3_moe(seed=6, mlp_only_layers=[1])
    cfg = BeamConfig.from_dict(hf.config.to_dict())
    source = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    ranges = _random_ranges(cfg, 1, fp8_exact=True)
    ref = BeamForCausalLM(cfg)
    load_state(ref, source.items())
    _reference_with(ref, ranges, exported, fake)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    ours, want = _logits(_our_checkpoint(tmp_path, cfg, source, "fp8", ranges), ids), _logits(ref.eval(), ids)
    assert torch.equal(ours, want)


def test_fp8_drafter_emulation_equals_modelopt_numerics(tmp_path):
    """The drafter exported in FP8 (decoder-layer GEMMs) drafts exactly what the reference drafter drafts with
    modelopt's FP8 numerics applied to the same GEMMs."""
    from modelopt.torch.export.model_config import QUANTIZATION_FP8
    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    from beamtrt.checkpoint.trtllm_files import load_drafter_checkpoint, write_checkpoint
    from beamtrt.config import DrafterConfig
    from beamtrt.models.beam import BeamForCausalLM, load_state
    from beamtrt.models.dflash2 import drafter_tensor_specs, load_state as load_drafter_state, random_drafter
    from beamtrt.models.random_beam import random_tensors

    def fake(x, amax):
        q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
        q.amax = torch.as_tensor(amax, dtype=torch.float32)
        return q(x)

    def exported(w, amax):
        scale = (amax.float() / 448).reshape(1)
        return to_quantized_weight(w, scale, QUANTIZATION_FP8).float() * scale

    cfg = BeamConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    target = BeamForCausalLM(cfg)
    load_state(target, random_tensors(cfg, seed=1, dtype=torch.float32, std=0.2))
    dcfg = DrafterConfig.for_target(cfg, num_hidden_layers=2, target_layer_ids=(0, 2), mask_token_id=0)
    gen = torch.Generator().manual_seed(4)
    source = {n: (torch.randn(shape, generator=gen) * 0.1 + n.endswith("norm.weight")).to(torch.bfloat16)
              for n, (shape, _, _) in drafter_tensor_specs(dcfg).items()}
    ranges = _random_ranges(cfg, 3, fp8_exact=True)
    ranges = {k: v for k, v in ranges.items() if int(k.split(".")[2]) < 2}  # the drafter's 2 layers
    mapping = trtllm.Mapping(2)
    units = trtllm.drafter_units(dcfg, mapping)
    items = trtllm.produce(units, source.__getitem__, mapping, "fp8", torch.bfloat16, ranges)
    write_checkpoint(tmp_path, trtllm.drafter_config(dcfg, mapping, torch.bfloat16, "fp8"),
                     trtllm.unit_specs(units, "fp8", torch.bfloat16), 2, items)
    ours = load_drafter_checkpoint(tmp_path, target, dtype=torch.float32)

    ref = random_drafter(dcfg, target)  # overwritten below
    names = drafter_tensor_specs(dcfg)
    load_drafter_state(ref, ((n, source[n].float()) for n in names))
    _reference_with(ref, ranges, exported, fake)
    taps = torch.randn(2, 9, 2 * 64, generator=gen)
    anchors = torch.tensor([5, 77])
    outs = []
    for model in (ours, ref):
        cache = model.new_cache(2)
        model.append_context(cache, taps)
        outs.append(model.draft(cache, anchors, 8))
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].scores, outs[1].scores)
    assert torch.equal(outs[0].cand_ids, outs[1].cand_ids)
