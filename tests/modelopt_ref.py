"""Test-only reference: quantize an HF model with nvidia-modelopt on CPU and export it (unified HF format).

Used to compare our own quantization / checkpoint conversion against modelopt tensor by tensor.
`quantize_and_export` takes any HF causal LM (e.g. from `tiny_qwen3_moe`), calibrates it with
`mtq.quantize(model, cfg, forward_loop)` (max calibration), records every quantizer's amax *before*
export (export rewrites them: fused groups get the group max), exports with `export_hf_checkpoint`
and returns the exported tensors by name.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

TINY_QWEN3_MOE = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "intermediate_size": 128, "max_position_embeddings": 128,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}


def tiny_qwen3_moe(seed: int = 0, dtype: torch.dtype = torch.bfloat16, std: float = 0.1, **overrides):
    """A random `transformers.Qwen3MoeForCausalLM` (vocab 256, hidden 64, 2 layers, 4 experts top-2)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **overrides}, initializer_range=std,
                         architectures=["Qwen3MoeForCausalLM"])  # export needs `architectures`
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    return model


def random_batches(vocab_size: int, n: int = 4, shape: tuple[int, int] = (2, 16), seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, shape, generator=g) for _ in range(n)]


@dataclass
class RefExport:
    tensors: dict[str, torch.Tensor]  # exported safetensors, by name
    weight_amax: dict[str, torch.Tensor]  # module name -> weight_quantizer.amax before export (fp32)
    input_amax: dict[str, torch.Tensor]  # module name -> input_quantizer.amax before export (fp32)
    kv_amax: dict[str, torch.Tensor] = field(default_factory=dict)  # "<attn>.k_bmm_quantizer" -> amax
    config: dict = field(default_factory=dict)  # exported config.json
    hf_quant_config: dict = field(default_factory=dict)  # exported hf_quant_config.json (if any)
    original: dict[str, torch.Tensor] = field(default_factory=dict)  # unquantized weights before export


def quant_config(name: str, kv_fp8: bool = False) -> dict:
    """A copy of mtq.<name> (e.g. "NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"), optionally + FP8 KV cache."""
    import copy

    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, name))
    if kv_fp8:
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    return cfg


def quantize_and_export(model, cfg: dict | str, batches: list[torch.Tensor], export_dir: str | Path) -> RefExport:
    """Calibrate `model` in place with modelopt (max calib over `batches`), export to `export_dir`."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.nn import TensorQuantizer
    from safetensors.torch import load_file

    if isinstance(cfg, str):
        cfg = quant_config(cfg)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches:
                m(ids)

    export_dir = Path(export_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(model, cfg, forward_loop)
        weight_amax, input_amax, kv_amax = {}, {}, {}
        for name, mod in model.named_modules():
            if not isinstance(mod, TensorQuantizer) or not mod.is_enabled or mod.amax is None:
                continue
            owner, _, qname = name.rpartition(".")
            amax = mod.amax.detach().float().clone()
            if qname == "weight_quantizer":
                weight_amax[owner] = amax
            elif qname == "input_quantizer":
                input_amax[owner] = amax
            elif qname in ("k_bmm_quantizer", "v_bmm_quantizer"):
                kv_amax[name] = amax
        export_hf_checkpoint(model, export_dir=str(export_dir))
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(export_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    config = json.loads((export_dir / "config.json").read_text())
    hq = export_dir / "hf_quant_config.json"
    return RefExport(tensors=tensors, weight_amax=weight_amax, input_amax=input_amax, kv_amax=kv_amax,
                     config=config, hf_quant_config=json.loads(hq.read_text()) if hq.exists() else {},
                     original=original)
