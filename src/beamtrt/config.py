"""Frozen model configs read from and written to Hugging Face `config.json` (Qwen3-MoE field names)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beamtrt.errors import ConfigError

# Fields Hugging Face writes that do not change the function the model computes.
_IGNORED_HF_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "initializer_range", "attention_dropout", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "max_window_layers", "sliding_window", "use_sliding_window", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "output_attentions", "output_hidden_states",
    "return_dict", "pretraining_tp", "mlp_bias", "layer_types", "quantization_config",
}) | frozenset((  # transformers' generic PretrainedConfig attributes (generation, task and export settings)
    "add_cross_attention bad_words_ids begin_suppress_tokens chunk_size_feed_forward cross_attention_hidden_size "
    "decoder_start_token_id diversity_penalty do_sample early_stopping encoder_no_repeat_ngram_size "
    "exponential_decay_length_penalty finetuning_task forced_bos_token_id forced_eos_token_id id2label "
    "is_decoder is_encoder_decoder label2id length_penalty max_length min_length no_repeat_ngram_size "
    "num_beam_groups num_beams num_return_sequences output_scores prefix problem_type pruned_heads "
    "remove_invalid_values repetition_penalty return_dict_in_generate sep_token_id suppress_tokens "
    "task_specific_params temperature tf_legacy_loss tie_encoder_decoder tokenizer_class top_k top_p "
    "torchscript typical_p use_bfloat16").split())
# Defaults that depend on the model family when a field is absent (Qwen2-MoE has no QK-norm and q/k/v bias).
_FAMILY_DEFAULTS = {
    "qwen3_moe": {"use_qk_norm": True, "qkv_bias": False},
    "qwen2_moe": {"use_qk_norm": False, "qkv_bias": True},
}
_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class BeamConfig:
    """The Beam target: a Qwen3-MoE-like decoder. Field names are the Hugging Face ones."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int            # dense-layer MLP width (layers in mlp_only_layers or off the sparse step)
    moe_intermediate_size: int        # per-expert MLP width
    num_experts: int                  # 0 = every layer dense
    num_experts_per_tok: int
    head_dim: int = 0                 # 0 = hidden_size // num_attention_heads
    norm_topk_prob: bool = True       # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1      # layer i is MoE iff (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert (Qwen2-MoE style: sigmoid-gated)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    use_qk_norm: bool = True          # per-head RMSNorm on q and k before RoPE (Qwen3)
    attention_bias: bool = False      # bias on q, k, v and o (Qwen3 convention)
    qkv_bias: bool = False            # bias on q, k, v only (Qwen2 convention)
    logit_scale: float = 1.0          # logits = lm_head(x) * logit_scale, then soft-capped
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
                _fail(f"num_attention_heads={self.num_attention_heads} does not divide "
                      f"hidden_size={self.hidden_size} (set head_dim explicitly)")
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "decoder_sparse_step", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                _fail(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                  f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            _fail(f"head_dim={self.head_dim} must be even for RoPE")
        for name in ("intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                     "shared_expert_intermediate_size"):  # 0 may mean unused; negative is always corrupt
            if getattr(self, name) < 0:
                _fail(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            _fail(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")
        if self.num_experts and self.moe_intermediate_size <= 0:
            _fail(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
        if any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers)) and self.intermediate_size <= 0:
            _fail(f"intermediate_size must be positive for dense layers, got {self.intermediate_size}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            _fail(f"mlp_only_layers {bad} out of range [0, {self.num_hidden_layers})")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0 or not math.isfinite(self.logit_scale):
            _fail("rms_norm_eps and rope_theta must be positive and logit_scale finite")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            _fail(f"final_logit_softcapping must be positive or null, got {self.final_logit_softcapping}")
        if self.hidden_act != "silu":
            _fail(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in _ROPE_TYPES:
                _fail(f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")

    # ---- derived layout -------------------------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    # ---- Hugging Face config.json ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> BeamConfig:
        """Build from a Hugging Face config dict; unknown or mistyped fields fail with one line naming them."""
        raw = dict(raw)
        model_type = raw.get("model_type", "qwen3_moe")
        if model_type not in _FAMILY_DEFAULTS:
            _fail(f"{source}: model_type {model_type!r} is not a Beam-family model "
                  f"(expected one of {', '.join(_FAMILY_DEFAULTS)})")
        if raw.get("use_sliding_window"):
            _fail(f"{source}: sliding-window attention in the target is not supported")
        kwargs = {**_FAMILY_DEFAULTS[model_type]}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in raw if k not in fields and k not in _IGNORED_HF_FIELDS)
        if unknown:
            _fail(f"{source}: unknown field(s) {', '.join(unknown)}")
        for name, value in raw.items():
            if name in fields and not (name == "head_dim" and value is None):
                kwargs[name] = _check_type(source, name, value, fields[name].type)
        missing = [f.name for f in fields.values()
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            _fail(f"{source}: missing required field(s) {', '.join(missing)}")
        if kwargs.get("mlp_only_layers") is None:
            kwargs["mlp_only_layers"] = ()
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_file(cls, path: str | Path) -> BeamConfig:
        from beamtrt.checkpoint.hf import read_json

        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_json(path, "config.json"), source=str(path))

    def save(self, path: str | Path) -> None:
        from beamtrt.checkpoint.hf import write_json

        path = Path(path)
        write_json(path / "config.json" if path.is_dir() else path, self.to_dict())


def _fail(message: str) -> None:
    raise ConfigError(message)


_TYPE_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}


def _check_type(source: str, name: str, value: Any, annotation: str) -> Any:
    """Check a JSON value against a field annotation (annotations are strings under `from __future__`)."""
    if value is None and "None" in annotation:
        return None
    if name == "mlp_only_layers":
        if not isinstance(value, list) or not all(_TYPE_CHECKS["int"](v) for v in value):
            _fail(f"{source}: mlp_only_layers must be a list of layer indices, got {value!r}")
        return tuple(value)
    if name == "rope_scaling":
        if not isinstance(value, dict):
            _fail(f"{source}: rope_scaling must be an object or null, got {value!r}")
        return value
    if name == "eos_token_id" and isinstance(value, list) and all(_TYPE_CHECKS["int"](v) for v in value):
        return value
    base = annotation.split("|")[0].strip()
    if not _TYPE_CHECKS[base](value):
        _fail(f"{source}: field {name} must be {base}, got {value!r}")
    return float(value) if base == "float" else value
