"""TensorRT-LLM checkpoints (config.json + rank{r}.safetensors): mapping, per-rank name tables, writer and reader.

One table of *units* describes a model: each unit turns a few Hugging Face tensors into the TensorRT-LLM tensors of
every rank (fused, split for tensor / expert parallelism, quantized) and, read back, into our reference parameters.
Names, fusions, scale tensors and their shapes follow TensorRT-LLM 1.2's loaders and what nvidia-modelopt's
TensorRT-LLM export writes (`reference/trtllm.md` §A4, §B1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from beamtrt.config import BeamConfig, DrafterConfig
from beamtrt.errors import CheckpointError, ConfigError
from beamtrt.quant import fp8, nvfp4

QUANT_ALGO = {"bf16": None, "fp8": "FP8", "nvfp4": "NVFP4"}
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class Mapping:
    """How ranks split the model (TensorRT-LLM's Mapping, no pipeline parallelism): tp ranks; within the MoE,
    moe_tp × moe_ep = tp (expert intermediate split × expert split). Rank r: moe_tp rank r // moe_ep, moe_ep
    rank r % moe_ep."""

    tp_size: int = 1
    moe_ep_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError(f"--tp must be at least 1, got {self.tp_size}")
        if self.moe_ep_size < 1 or self.tp_size % self.moe_ep_size:
            raise ConfigError(f"--moe-ep {self.moe_ep_size} must divide --tp {self.tp_size}")

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.moe_ep_size

    def moe_ranks(self, rank: int) -> tuple[int, int]:
        """(moe_tp rank, moe_ep rank) of a rank."""
        return rank // self.moe_ep_size, rank % self.moe_ep_size

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "tp_size": self.tp_size, "pp_size": 1, "cp_size": 1,
                "moe_tp_size": self.moe_tp_size, "moe_ep_size": self.moe_ep_size}

    @classmethod
    def from_json(cls, raw: dict, source: str) -> Mapping:
        def whole(key: str, default: int | None) -> int:
            value = raw.get(key, default)
            if type(value) is not int:  # int() read 2.9 as 2 and failed on null in a traceback
                raise CheckpointError(f"{source}: 'mapping' needs integer tp_size (and moe_ep_size, pp_size, "
                                      f"moe_tp_size), got {key} {value!r}")
            return value

        tp, ep = whole("tp_size", None), whole("moe_ep_size", 1)
        if tp < 1 or ep < 1 or tp % ep:
            raise CheckpointError(f"{source}: 'mapping' has tp_size {tp} and moe_ep_size {ep}: tp_size must be at "
                                  "least 1 and moe_ep_size divide it")
        mapping = cls(tp, ep)
        if whole("pp_size", 1) != 1 or whole("moe_tp_size", mapping.moe_tp_size) != mapping.moe_tp_size:
            raise CheckpointError(f"{source}: unsupported mapping {raw} (pp_size must be 1, moe_tp × moe_ep = tp)")
        return mapping


def _split(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ConfigError(f"{what} ({n}) is not divisible by {parts}")
    return n // parts


# ---- units ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    """One source tensor of a unit and how a rank takes its piece (and how pieces go back together)."""

    source: str                          # HF tensor name ("{e}" = expert index for expert units)
    pieces: int                          # distinct pieces along `dim` (1 = replicated)
    dim: int                             # split dim of the source tensor
    piece_of: Callable[[int], int]       # rank -> which piece it holds (several ranks may hold the same piece)

    def take(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        return t.chunk(self.pieces, self.dim)[self.piece_of(rank)] if self.pieces > 1 else t


@dataclass(frozen=True)
class Plain:
    """A tensor kept in high precision (norms, embedding, LM head, router, convs, selector)."""

    name: str
    part: Part
    shape: tuple[int, ...]               # per rank
    dtype: torch.dtype | None = None     # None = the checkpoint dtype

    def specs(self, dtype: torch.dtype) -> dict[str, Spec]:
        return {self.name: (self.shape, self.dtype or dtype)}


@dataclass(frozen=True)
class Linear:
    """A quantizable GEMM: parts concatenated along the output dim per rank ([out, in] weights), optionally one
    per expert (stacked [E_local, out, in]); `act` names the calibration site of its input."""

    name: str                            # module prefix, e.g. transformer.layers.0.attention.qkv
    parts: tuple[Part, ...]
    shape: tuple[int, int]               # per-rank [out, in] (per expert)
    act: str                             # amax key of the input activation
    experts: tuple[int, ...] = ()        # expert ids per rank slot (EP): experts[rank][i]; () = not an expert unit
    expert_slots: int = 0                # E_local
    bias: tuple[Part, ...] = ()          # bias parts (same split as the weight rows)
    scale_peers: tuple[str, ...] = ()    # other sources sharing the weight scale (dense gate/up, as modelopt fuses)

    def specs(self, precision: str, dtype: torch.dtype) -> dict[str, Spec]:
        out, inp = self.shape
        lead = (self.expert_slots,) if self.expert_slots else ()
        scalar = (self.expert_slots,) if self.expert_slots else ()
        s: dict[str, Spec] = {}
        if precision == "bf16":
            s[f"{self.name}.weight"] = (lead + (out, inp), dtype)
        elif precision == "fp8":
            s[f"{self.name}.weight"] = (lead + (out, inp), torch.float8_e4m3fn)
            s[f"{self.name}.weights_scaling_factor"] = ((self.expert_slots, 1) if lead else (1,), torch.float32)
            s[f"{self.name}.activation_scaling_factor"] = ((1,), torch.float32)
        else:
            s[f"{self.name}.weight"] = (lead + (out, inp // 2), torch.uint8)
            s[f"{self.name}.weights_scaling_factor"] = (lead + (out, inp // nvfp4.BLOCK), torch.float8_e4m3fn)
            s[f"{self.name}.weights_scaling_factor_2"] = (scalar, torch.float32)
            s[f"{self.name}.activation_scaling_factor"] = ((1,) if lead else (), torch.float32)
        if self.bias:
            s[f"{self.name}.bias"] = ((out,), dtype)
        return s


Unit = Plain | Linear


class _Split:
    """Part factories for one mapping."""

    def __init__(self, mapping: Mapping):
        self.m = mapping

    def rep(self, source: str) -> Part:
        return Part(source, 1, 0, lambda r: 0)

    def col(self, source: str) -> Part:  # column-parallel: output rows across tp
        return Part(source, self.m.tp_size, 0, lambda r: r)

    def row(self, source: str) -> Part:  # row-parallel: input columns across tp
        return Part(source, self.m.tp_size, 1, lambda r: r)

    def kv(self, source: str, n_kv: int) -> Part:
        """K or V rows: split by head, or each head duplicated onto tp / n_kv ranks when n_kv < tp."""
        tp = self.m.tp_size
        if n_kv >= tp:
            return Part(source, tp, 0, lambda r: r)
        return Part(source, n_kv, 0, lambda r: r // (tp // n_kv))

    def moe_col(self, source: str) -> Part:
        mt, ep = self.m.moe_tp_size, self.m.moe_ep_size
        return Part(source, mt, 0, lambda r: r // ep)

    def moe_row(self, source: str) -> Part:
        mt, ep = self.m.moe_tp_size, self.m.moe_ep_size
        return Part(source, mt, 1, lambda r: r // ep)


def _check_heads(n_q: int, n_kv: int, tp: int, what: str) -> None:
    if n_q % tp:
        raise ConfigError(f"TP {tp} does not divide the {what}'s {n_q} attention heads")
    if n_kv % tp and tp % n_kv:
        raise ConfigError(f"TP {tp} and the {what}'s {n_kv} KV heads: one must divide the other")


def _attention(sp: _Split, hf: str, trt: str, n_q: int, n_kv: int, head_dim: int, hidden: int,
               qkv_bias: bool, o_bias: bool, qk_norm: bool) -> list[Unit]:
    tp = sp.m.tp_size
    kv_local = max(n_kv // tp, 1)
    parts = (sp.col(hf + "q_proj.weight"), sp.kv(hf + "k_proj.weight", n_kv), sp.kv(hf + "v_proj.weight", n_kv))
    bias = ()
    if qkv_bias:
        bias = (sp.col(hf + "q_proj.bias"), sp.kv(hf + "k_proj.bias", n_kv), sp.kv(hf + "v_proj.bias", n_kv))
    units: list[Unit] = [
        Linear(trt + "attention.qkv", parts, ((n_q // tp + 2 * kv_local) * head_dim, hidden),
               act=trt + "attention.qkv", bias=bias),
        Linear(trt + "attention.dense", (sp.row(hf + "o_proj.weight"),), (hidden, n_q // tp * head_dim),
               act=trt + "attention.dense"),
    ]
    if o_bias:
        units.append(Plain(trt + "attention.dense.bias", sp.rep(hf + "o_proj.bias"), (hidden,)))
    if qk_norm:
        for src, dst in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            units.append(Plain(trt + f"attention.{dst}.weight", sp.rep(hf + f"{src}.weight"), (head_dim,)))
    return units


def _layer_norms(sp: _Split, hf: str, trt: str, hidden: int) -> list[Unit]:
    return [Plain(trt + "input_layernorm.weight", sp.rep(hf + "input_layernorm.weight"), (hidden,)),
            Plain(trt + "post_layernorm.weight", sp.rep(hf + "post_attention_layernorm.weight"), (hidden,))]


def _gated_mlp(sp: _Split, hf: str, trt: str, hidden: int, inter: int) -> list[Unit]:
    """Dense SwiGLU: fc = gate_proj, gate = up_proj (both column-parallel, one shared weight scale), proj =
    down_proj (row-parallel)."""
    I = _split(inter, sp.m.tp_size, "intermediate size")
    return [
        Linear(trt + "mlp.fc", (sp.col(hf + "gate_proj.weight"),), (I, hidden), act=trt + "mlp.fc",
               scale_peers=(hf + "up_proj.weight",)),
        Linear(trt + "mlp.gate", (sp.col(hf + "up_proj.weight"),), (I, hidden), act=trt + "mlp.fc",
               scale_peers=(hf + "gate_proj.weight",)),
        Linear(trt + "mlp.proj", (sp.row(hf + "down_proj.weight"),), (hidden, I), act=trt + "mlp.proj"),
    ]


# ---- the target ----------------------------------------------------------------------------------------------

def target_architecture(cfg: BeamConfig) -> tuple[str, str | None]:
    """(TensorRT-LLM architecture, qwen_type). QK-norm targets are Qwen3-MoE. Without QK-norm, a target whose MoE is
    renormalized top-k with no shared expert and no bias computes exactly Mixtral's function (llama attention, no
    QK-norm, softmax over the top-k router logits), so it exports as MixtralForCausalLM; Qwen2-MoE covers the rest.
    """
    if cfg.use_qk_norm:
        return "Qwen3MoeForCausalLM", "qwen3_moe"
    plain = not (cfg.attention_bias or cfg.qkv_bias or cfg.shared_expert_intermediate_size)
    if plain and cfg.norm_topk_prob and all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        return "MixtralForCausalLM", None
    return "Qwen2MoeForCausalLM", "qwen2_moe"


def padded_vocab(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def target_units(cfg: BeamConfig, mapping: Mapping) -> list[Unit]:
    """Every unit of a Beam target under `mapping`; raises ConfigError when the mapping cannot split it."""
    sp, tp = _Split(mapping), mapping.tp_size
    H, D = cfg.hidden_size, cfg.head_dim
    _check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp, "target")
    V = padded_vocab(cfg.vocab_size, tp)
    units: list[Unit] = [
        Plain("transformer.vocab_embedding.weight", sp.col("model.embed_tokens.weight"), (V // tp, H)),
        Plain("transformer.ln_f.weight", sp.rep("model.norm.weight"), (H,)),
        Plain("lm_head.weight", sp.col("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"),
              (V // tp, H)),
    ]
    for i in range(cfg.num_hidden_layers):
        hf, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        units += _layer_norms(sp, hf, trt, H)
        units += _attention(sp, hf + "self_attn.", trt, cfg.num_attention_heads,
                            cfg.num_key_value_heads, D, H, cfg.attention_bias or cfg.qkv_bias, cfg.attention_bias,
                            cfg.use_qk_norm)
        if not cfg.is_moe_layer(i):
            units += _gated_mlp(sp, hf + "mlp.", trt, H, cfg.intermediate_size)
            continue
        E, mt, ep = cfg.num_experts, mapping.moe_tp_size, mapping.moe_ep_size
        I = _split(cfg.moe_intermediate_size, mt, f"moe_intermediate_size with moe_tp {mt}")
        E_local = _split(E, ep, f"the number of experts with moe_ep {ep}")
        experts = tuple(tuple(range(mapping.moe_ranks(r)[1] * E_local, (mapping.moe_ranks(r)[1] + 1) * E_local))
                        for r in range(tp))
        ex = hf + "mlp.experts.{e}."
        units += [
            Plain(trt + "mlp.router.weight", sp.rep(hf + "mlp.gate.weight"), (E, H), dtype=torch.float32),
            Linear(trt + "mlp.fc", (sp.moe_col(ex + "up_proj.weight"), sp.moe_col(ex + "gate_proj.weight")),
                   (2 * I, H), act=trt + "mlp.fc", experts=experts, expert_slots=E_local),
            Linear(trt + "mlp.proj", (sp.moe_row(ex + "down_proj.weight"),), (H, I), act=trt + "mlp.proj",
                   experts=experts, expert_slots=E_local),
        ]
        if cfg.shared_expert_intermediate_size:
            S = _split(cfg.shared_expert_intermediate_size, tp, "shared_expert_intermediate_size")
            sh, st = hf + "mlp.shared_expert.", trt + "mlp.shared_expert."
            units += [
                Linear(st + "fc", (sp.col(sh + "up_proj.weight"), sp.col(sh + "gate_proj.weight")), (2 * S, H),
                       act=st + "fc"),
                Linear(st + "proj", (sp.row(sh + "down_proj.weight"),), (H, S), act=st + "proj"),
                Plain(trt + "mlp.shared_expert_gate.weight", sp.rep(hf + "mlp.shared_expert_gate.weight"), (1, H)),
            ]
    return units


def kv_sites(num_layers: int) -> list[str]:
    return [f"transformer.layers.{i}.attention" for i in range(num_layers)]


def target_config(cfg: BeamConfig, mapping: Mapping, precision: str, kv_cache: str, dtype: torch.dtype) -> dict:
    """The TensorRT-LLM config.json of a Beam target."""
    arch, qwen_type = target_architecture(cfg)
    quant = {"quant_algo": QUANT_ALGO[precision], "kv_cache_quant_algo": "FP8" if kv_cache == "fp8" else None,
             "group_size": nvfp4.BLOCK if precision == "nvfp4" else 128, "has_zero_point": False,
             "pre_quant_scale": False, "exclude_modules": exclude_modules(cfg) if precision != "bf16" else None}
    out = {
        "architecture": arch, "dtype": DTYPE_NAMES[dtype], "logits_dtype": "float32",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_size": cfg.head_dim, "hidden_act": "swiglu",
        "intermediate_size": cfg.moe_intermediate_size if arch == "MixtralForCausalLM" else cfg.intermediate_size,
        "norm_epsilon": cfg.rms_norm_eps, "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": cfg.max_position_embeddings, "rotary_base": cfg.rope_theta,
        "seq_length": cfg.max_position_embeddings,  # QWenDecoderLayer reads it (logn scaling, off: use_logn_attn)
        "use_logn_attn": False,
        "rotary_scaling": cfg.rope_scaling, "use_parallel_embedding": True, "embedding_sharding_dim": 0,
        "share_embedding_table": False, "tie_word_embeddings": cfg.tie_word_embeddings,
        "mapping": mapping.to_json(), "quantization": quant,
        "moe": {"num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
                "normalization_mode": 1 if cfg.norm_topk_prob else 0,  # 1 = RENORMALIZE, 0 = NONE
                "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size},
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "moe_shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "attn_bias": cfg.attention_bias or cfg.qkv_bias, "mlp_bias": False,
        "beam_config": cfg.to_dict(),  # the exact source config: the reader rebuilds the reference model from it
    }
    if qwen_type:
        out["qwen_type"] = qwen_type
    return out


def exclude_modules(cfg: BeamConfig) -> list[str]:
    """Modules left in high precision (TensorRT-LLM checkpoint names): the LM head, routers and shared-expert gates
    (the embedding and norms are never quantized)."""
    names = ["lm_head"]
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            names.append(f"transformer.layers.{i}.mlp.router")
            if cfg.shared_expert_intermediate_size:
                names.append(f"transformer.layers.{i}.mlp.shared_expert_gate")
    return names


# ---- the drafter ---------------------------------------------------------------------------------------------

DRAFTER_ARCHITECTURE = "DFlash2DraftModel"


def drafter_units(cfg: DrafterConfig, mapping: Mapping) -> list[Unit]:
    """The drafter under the same conventions. Its embedding and LM head are the target's (not exported); the
    fusion fc, norms, convs and selector projection are replicated; the selector codebooks are vocab-parallel."""
    sp, tp = _Split(mapping), mapping.tp_size
    H, D, V = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    _check_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp, "drafter")
    if V % tp:
        raise ConfigError(f"TP {tp} does not divide the drafter's vocabulary ({V})")
    units: list[Unit] = [
        Plain("transformer.fc.weight", sp.rep("fc.weight"), (H, cfg.num_taps * H)),
        Plain("transformer.hidden_norm.weight", sp.rep("hidden_norm.weight"), (H,)),
        Plain("transformer.ln_f.weight", sp.rep("norm.weight"), (H,)),
    ]
    r = cfg.selector_rank
    for book in ("predecessor_codebook", "successor_codebook") if cfg.version == 2 else ():
        units.append(Plain(f"candidate_selector.{book}", sp.col(f"candidate_selector.{book}"), (V // tp, r)))
    if cfg.version == 2:  # DFlash v1 drafters have no selector and no convs
        units.append(Plain("candidate_selector.hidden_projection.weight",
                           sp.rep("candidate_selector.hidden_projection.weight"), (r, H)))
    G = H // cfg.conv_group_size
    for i in range(cfg.num_hidden_layers):
        hf, trt = f"layers.{i}.", f"transformer.layers.{i}."
        units += _layer_norms(sp, hf, trt, H)
        units += _attention(sp, hf + "self_attn.", trt, cfg.num_attention_heads,
                            cfg.num_key_value_heads, D, H, False, False, True)
        units += _gated_mlp(sp, hf + "mlp.", trt, H, cfg.intermediate_size)
        for conv in ("attention_conv", "mlp_conv") if cfg.version == 2 else ():
            units += [
                Plain(trt + f"{conv}.base_kernel", sp.rep(hf + f"{conv}.base_kernel"), (2, cfg.conv_kernel_size, H)),
                Plain(trt + f"{conv}.kernel_projection.weight", sp.rep(hf + f"{conv}.kernel_projection.weight"),
                      (2 * cfg.conv_kernel_size * G, H)),
            ]
    return units


def drafter_config(cfg: DrafterConfig, mapping: Mapping, dtype: torch.dtype, precision: str = "bf16") -> dict:
    """The drafter's config.json: FP8 quantizes its decoder layers' GEMMs; the fusion fc, norms, convs and the
    selector stay high precision."""
    exclude = ["transformer.fc", "candidate_selector"] if precision != "bf16" else None
    return {"architecture": DRAFTER_ARCHITECTURE, "dtype": DTYPE_NAMES[dtype], "mapping": mapping.to_json(),
            "quantization": {"quant_algo": QUANT_ALGO[precision], "kv_cache_quant_algo": None,
                             "exclude_modules": exclude},
            "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "head_size": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                              "block_size": cfg.block_size},
            "drafter_config": cfg.to_dict()}


# ---- specs of a whole checkpoint -----------------------------------------------------------------------------

def unit_specs(units: list[Unit], precision: str, dtype: torch.dtype, kv_cache: str = "auto",
               num_layers: int = 0) -> dict[str, Spec]:
    """name -> (shape, dtype) of every tensor in each rank file (all ranks hold the same names and shapes)."""
    specs: dict[str, Spec] = {}
    for unit in units:
        specs.update(unit.specs(dtype) if isinstance(unit, Plain) else unit.specs(precision, dtype))
    if kv_cache == "fp8":
        for site in kv_sites(num_layers):
            for kind in ("k", "v", "kv"):
                specs[f"{site}.{kind}_cache_scaling_factor"] = ((1,), torch.float32)
    return specs


def tensor_dtype(name: str, raw: str) -> torch.dtype:
    for dtype, label in DTYPE_NAMES.items():
        if label == raw:
            return dtype
    raise CheckpointError(f"{name}: unsupported dtype {raw!r}")


# ---- producing rank tensors ----------------------------------------------------------------------------------

Sources = Callable[[str], torch.Tensor]  # HF name -> tensor
Warn = Callable[[str], None] | None  # told a warning's line


def _cast(t: torch.Tensor, dtype: torch.dtype, names: list[str]) -> torch.Tensor:
    """`t` in the dtype the build writes; a value beyond that dtype's range is named by its source tensors (the
    rank-file check named the output file: 'has NaN or Inf values'). Sources are checked finite as they are read."""
    out = t.to(dtype)
    if (t.is_floating_point() and torch.finfo(dtype).max < torch.finfo(t.dtype).max
            and not bool(torch.isfinite(out).all())):
        raise CheckpointError(f"{', '.join(names)}: values up to {t.abs().amax().item():.4g} overflow "
                              f"{DTYPE_NAMES[dtype]}, the dtype the build writes this checkpoint in: save the "
                              "checkpoint in one dtype, bfloat16 or float32")
    return out


def _quantize(precision: str, w: torch.Tensor, weight_amax: torch.Tensor | None,
              dtype: torch.dtype, names: list[str]) -> dict[str, torch.Tensor]:
    """Quantize one rank's [out, in] weight (of the source tensors `names`) with the group's shared weight amax
    (fp32 scalar; None in bf16)."""
    if precision == "bf16":
        return {"weight": _cast(w, dtype, names)}
    if precision == "fp8":
        scale = fp8.scale_from_amax(weight_amax)
        # one fp32 division, as modelopt's TensorRT-LLM export does (its (1,)-shaped scale promotes to fp32)
        return {"weight": fp8.quantize(w.float(), scale), "weights_scaling_factor": scale.reshape(1)}
    packed, block, scale_2 = nvfp4.quantize_weight(w, nvfp4.global_scale(weight_amax))
    return {"weight": packed, "weights_scaling_factor": block, "weights_scaling_factor_2": scale_2.reshape(())}


# what a zero amax becomes, as modelopt's export does, so that its scale stays positive: the quantizer's largest value
# (an all-zero weight group, a pruned expert, quantizes to zeros whatever the scale; so does an activation that
# calibration never saw non-zero); a positive one is at least fp32's smallest normal (modelopt's clamp)
ZERO_AMAX = {"fp8": fp8.E4M3_MAX, "nvfp4": nvfp4.E2M1_MAX}
TINY_AMAX = torch.finfo(torch.float32).tiny


def _weight_amax(weights: list[torch.Tensor], names: list[str], precision: str, warn: Warn) -> torch.Tensor | None:
    """The largest |value| over a group of weights that share one scale (fp32 scalar; None in bf16, which has no
    scale: a pass over every weight saved); an all-zero group is warned about (a pruned expert, or a broken
    checkpoint), as modelopt's export warns."""
    if precision == "bf16":
        return None
    amax = torch.stack([w.abs().amax().float() for w in weights]).amax()
    if not torch.isfinite(amax):  # the checkpoint reader refuses these first; never quantized into a scale
        raise CheckpointError(f"{', '.join(names)}: NaN or Inf values cannot be quantized")
    if amax > 0:
        return amax.clamp(min=TINY_AMAX)
    if warn is not None:
        warn(f"warning: {', '.join(names)}: all zeros; quantized to zeros with the scale of amax "
             f"{ZERO_AMAX[precision]:g}, as modelopt's export does")
    return torch.tensor(ZERO_AMAX[precision])


def act_scale(precision: str, amax: float) -> torch.Tensor:
    """An activation's scale from its calibrated range (ZERO_AMAX and TINY_AMAX as for weights)."""
    a = torch.tensor(float(amax) or ZERO_AMAX[precision], dtype=torch.float32).clamp(min=TINY_AMAX)
    return fp8.scale_from_amax(a) if precision == "fp8" else nvfp4.global_scale(a)


def produce(units: list[Unit], get: Sources, mapping: Mapping, precision: str, dtype: torch.dtype,
            amax: dict[str, float], warn: Warn = None) -> Iterator[tuple[int, str, torch.Tensor, int | None]]:
    """Yield (rank, name, tensor, expert slot or None) for every unit, loading each source tensor once per unit
    (per expert for expert units), so memory holds one unit (one expert) at a time. warn(line) is told of all-zero
    weight groups."""
    ranks = range(mapping.tp_size)
    for unit in units:
        if isinstance(unit, Plain):
            full = get(unit.part.source)
            for r in ranks:
                piece = unit.part.take(full, r)
                if piece.shape[0] < unit.shape[0]:  # vocab padded to a multiple of tp: zero rows
                    piece = torch.cat((piece, piece.new_zeros(unit.shape[0] - piece.shape[0], *piece.shape[1:])))
                yield r, unit.name, _cast(piece, unit.dtype or dtype, [unit.part.source]).contiguous(), None
            continue
        if unit.expert_slots:
            yield from _produce_experts(unit, get, mapping, precision, dtype, amax, warn)
            continue
        names = [p.source for p in unit.parts]
        fulls = [get(n) for n in names]
        peers = [get(n) for n in unit.scale_peers] if precision != "bf16" else []
        weight_amax = _weight_amax(fulls + peers, names, precision, warn)  # shared by the group
        biases = [get(p.source) for p in unit.bias]
        for r in ranks:
            w = torch.cat([p.take(f, r) for p, f in zip(unit.parts, fulls)])
            for key, t in _quantize(precision, w, weight_amax, dtype, names).items():
                yield r, f"{unit.name}.{key}", t, None
            if precision != "bf16":
                yield r, f"{unit.name}.activation_scaling_factor", _act_tensor(unit, precision, amax), None
            if biases:
                bias = torch.cat([p.take(b, r) for p, b in zip(unit.bias, biases)])
                yield r, f"{unit.name}.bias", _cast(bias, dtype, [p.source for p in unit.bias]), None


def _act_tensor(unit: Linear, precision: str, amax: dict[str, float]) -> torch.Tensor:
    if unit.act not in amax:
        raise CheckpointError(f"calibration has no activation range for {unit.act}")
    s = act_scale(precision, amax[unit.act])
    return s.reshape(1) if precision == "fp8" or unit.expert_slots else s.reshape(())


def _produce_experts(unit: Linear, get: Sources, mapping: Mapping, precision: str, dtype: torch.dtype,
                     amax: dict[str, float], warn: Warn) -> Iterator[tuple[int, str, torch.Tensor, int | None]]:
    holders: dict[int, list[tuple[int, int]]] = {}  # expert -> [(rank, slot)]
    for r, ids in enumerate(unit.experts):
        for slot, e in enumerate(ids):
            holders.setdefault(e, []).append((r, slot))
    for e in sorted(holders):
        names = [p.source.format(e=e) for p in unit.parts]
        fulls = [get(n) for n in names]
        weight_amax = _weight_amax(fulls, names, precision, warn)
        for r, slot in holders[e]:
            w = torch.cat([p.take(f, r) for p, f in zip(unit.parts, fulls)])
            for key, t in _quantize(precision, w, weight_amax, dtype, names).items():
                if key == "weights_scaling_factor" and precision == "fp8":
                    t = t.reshape(1)
                yield r, f"{unit.name}.{key}", t, slot
    if precision != "bf16":
        for r in range(mapping.tp_size):
            yield r, f"{unit.name}.activation_scaling_factor", _act_tensor(unit, precision, amax), None


def kv_cache_scales(num_layers: int, amax: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
    """FP8 KV-cache scales per layer: k and v from their calibrated ranges, at least 1.0 (as nvidia-modelopt's
    TensorRT-LLM export clamps them), and kv = the larger (what TensorRT-LLM uses for both)."""
    one = torch.ones(1)
    for site in kv_sites(num_layers):
        k, v = (torch.maximum(fp8.scale_from_amax(torch.tensor(float(amax[f"{site}.{x}_cache"]))).reshape(1), one)
                for x in "kv")
        yield from ((f"{site}.k_cache_scaling_factor", k), (f"{site}.v_cache_scaling_factor", v),
                    (f"{site}.kv_cache_scaling_factor", torch.maximum(k, v)))


# ---- reading rank tensors back -------------------------------------------------------------------------------

RankTensors = Callable[[int, str], torch.Tensor]  # (rank, name) -> tensor


def dequantize_unit(precision: str, get: Callable[[str], torch.Tensor], prefix: str, slot: int | None
                    ) -> torch.Tensor:
    """One rank's weight of a Linear unit (`prefix`; expert `slot` of a stacked one), dequantized to fp32."""
    def one(key: str) -> torch.Tensor:
        t = get(f"{prefix}.{key}")
        return t if slot is None else t[slot]
    if precision == "bf16":
        return one("weight").float()
    if precision == "fp8":
        return fp8.dequantize(one("weight"), one("weights_scaling_factor").reshape(()))
    return nvfp4.dequantize_weight(one("weight"), one("weights_scaling_factor"), one("weights_scaling_factor_2"))


def _assemble(parts: tuple[Part, ...], by_rank: dict[int, torch.Tensor], rows: list[int]) -> list[torch.Tensor]:
    """Invert the split: per-rank fused rows -> each part's full tensor (duplicated pieces are read once)."""
    pieces: list[dict[int, torch.Tensor]] = [{} for _ in parts]
    for r, fused in by_rank.items():
        for i, chunk in enumerate(fused.split(rows)):
            pieces[i].setdefault(parts[i].piece_of(r), chunk)
    return [torch.cat([got[k] for k in range(p.pieces)], dim=p.dim) for p, got in zip(parts, pieces)]


def _rows(parts: tuple[Part, ...], names: list[str], shapes: dict[str, tuple[int, ...]]) -> list[int]:
    """Rows each part contributes to one rank's fused tensor."""
    return [shapes[n][0] // p.pieces if p.dim == 0 else shapes[n][0] for p, n in zip(parts, names)]


def unshard(units: list[Unit], get: RankTensors, tp: int, precision: str,
            source_shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every source tensor, rebuilt from the rank files: quantized weights dequantized
    to fp32, vocabulary padding dropped. For bf16 it inverts produce() bit for bit."""
    for unit in units:
        if isinstance(unit, Plain):
            by_rank = {r: get(r, unit.name) for r in range(tp)}
            full = _assemble((unit.part,), by_rank, [by_rank[0].shape[0]])[0]
            yield unit.part.source, full[:source_shapes[unit.part.source][0]]
        elif unit.expert_slots:
            for slot in range(unit.expert_slots):
                holders: dict[int, dict[int, torch.Tensor]] = {}  # expert -> {rank: its fused weight}
                for r, ids in enumerate(unit.experts):
                    holders.setdefault(ids[slot], {})[r] = dequantize_unit(precision, lambda n, r=r: get(r, n),
                                                                       unit.name, slot)
                for e, by_rank in holders.items():
                    names = [p.source.format(e=e) for p in unit.parts]
                    yield from zip(names, _assemble(unit.parts, by_rank, _rows(unit.parts, names, source_shapes)))
        else:
            names = [p.source for p in unit.parts]
            rows = _rows(unit.parts, names, source_shapes)
            by_rank = {r: dequantize_unit(precision, lambda n, r=r: get(r, n), unit.name, None) for r in range(tp)}
            yield from zip(names, _assemble(unit.parts, by_rank, rows))
            if unit.bias:
                biases = {r: get(r, f"{unit.name}.bias") for r in range(tp)}
                yield from zip((p.source for p in unit.bias), _assemble(unit.bias, biases, rows))
