"""Frozen configs: the models' (Hugging Face `config.json`, Qwen3-MoE field names), the build's and the engines',
and the block-size and draft-threshold checks."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from beamtrt.errors import CheckpointError, ConfigError

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
_ROPE_TYPES = {"default": (), "linear": ("factor",),  # rope_scaling's type -> its fields, each a positive number
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
# Far above any real model; a damaged count beyond them would fill memory with per-layer / per-expert name tables
# (a config.json of 10^12 layers was an out-of-memory kill) before the weights could say that it is wrong.
MAX_LAYERS, MAX_EXPERTS_IN_ALL = 10_000, 1_000_000


class _HFConfig:
    """What the config dataclasses share: config.json file I/O, construction with the file named in errors, and
    the attention shape fields (heads, head_dim, RoPE) they both have.

    Subclasses define from_dict(raw, source) and to_dict().
    """

    @classmethod
    def from_file(cls, path: str | Path):
        from beamtrt.checkpoint.hf import read_json

        path = Path(path)
        if path.is_dir() and path.name != "config.json":  # a checkpoint folder (a folder named config.json: named)
            path = path / "config.json"
        return cls.from_dict(read_json(path, "config.json"), source=str(path))

    def save(self, path: str | Path) -> None:
        from beamtrt.checkpoint.hf import write_json

        path = Path(path)
        write_json(path / "config.json" if path.is_dir() else path, self.to_dict())

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def _check_shape(self, positive: tuple[str, ...]) -> None:
        """The named sizes are positive, KV heads divide query heads, head_dim is even (RoPE)."""
        for name in positive:
            if getattr(self, name) <= 0:
                _fail(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                  f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            _fail(f"head_dim={self.head_dim} must be even for RoPE")

    def _check_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        rope_type = rs.get("rope_type", rs.get("type"))
        if not isinstance(rope_type, str) or rope_type not in _ROPE_TYPES:
            _fail(f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})")
        for name in _ROPE_TYPES[rope_type]:
            value = rs.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                _fail(f"rope_scaling type {rope_type!r} needs {name}, a positive number; got {value!r}")
        if rope_type == "llama3" and rs["high_freq_factor"] <= rs["low_freq_factor"]:
            _fail(f"rope_scaling: high_freq_factor {rs['high_freq_factor']} must be above low_freq_factor "
                  f"{rs['low_freq_factor']}")

    def _derive_head_dim(self) -> None:
        """head_dim 0 means hidden_size // num_attention_heads, which must then divide evenly."""
        if self.head_dim == 0:
            if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
                _fail(f"num_attention_heads={self.num_attention_heads} does not divide "
                      f"hidden_size={self.hidden_size} (set head_dim explicitly)")
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))

    @classmethod
    def _construct(cls, kwargs: dict[str, Any], source: str):
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in kwargs]
        if missing:
            _fail(f"{source}: missing required field(s) {', '.join(missing)}")
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


@dataclass(frozen=True)
class BeamConfig(_HFConfig):
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
        self._derive_head_dim()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        self._validate()

    def _validate(self) -> None:
        self._check_shape(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "decoder_sparse_step", "max_position_embeddings"))
        for name in ("intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                     "shared_expert_intermediate_size"):  # 0 may mean unused; negative is always corrupt
            if getattr(self, name) < 0:
                _fail(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_hidden_layers > MAX_LAYERS or self.num_hidden_layers * self.num_experts > MAX_EXPERTS_IN_ALL:
            _fail(f"num_hidden_layers={self.num_hidden_layers} × num_experts={self.num_experts} is beyond any real "
                  f"model (at most {MAX_LAYERS:,} layers, {MAX_EXPERTS_IN_ALL:,} experts in all): a damaged config?")
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
        if any(not 0 <= i < self.vocab_size for i in self.eos_token_ids):  # never sampled: decoding would not stop
            _fail(f"eos_token_id {self.eos_token_id} outside the vocabulary [0, {self.vocab_size})")
        self._check_rope_scaling()

    # ---- derived layout -------------------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """eos_token_id as a tuple, whether the config gives one id, a list or none."""
        eos = self.eos_token_id
        return (eos,) if isinstance(eos, int) else tuple(eos or ())

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        """How many layers are MoE (is_moe_layer); the rest are dense."""
        return sum(map(self.is_moe_layer, range(self.num_hidden_layers)))

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
        if kwargs.get("mlp_only_layers") is None:
            kwargs["mlp_only_layers"] = ()
        return cls._construct(kwargs, source)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


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


# ---- DFlash / DFlash 2 drafter -------------------------------------------------------------------------------

_DRAFTER_ARCHITECTURES = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2}
_DFLASH_SUBFIELDS = ("mask_token_id", "target_layer_ids", "block_size")
# Fields written by HF / the DFlash trainers that do not change what the drafter computes (checked ones aside).
_DRAFTER_IGNORED = frozenset({
    "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "attention_dropout", "max_window_layers", "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id",
    "tie_word_embeddings", "pretraining_tp", "mlp_bias", "output_attentions", "output_hidden_states",
    "return_dict",
})
# Fields the drafter supports only at one value (anything else changes the function it computes).
_DRAFTER_FIXED = {"hidden_act": "silu", "attention_bias": False, "is_causal": False}


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """DFlash's default taps when a config has none: round(1 + i·(L−4)/(n−1)), first tap 1, last L−3.

    Small targets (L < 5) where that rule degenerates get n taps spread evenly over [0, L).
    """
    if num_taps == 1:
        return (num_target_layers // 2,)
    if num_target_layers >= 5:
        start, span = 1, num_target_layers - 4
    else:
        start, span = 0, num_target_layers - 1
    return tuple(int(round(start + i * span / (num_taps - 1))) for i in range(num_taps))


@dataclass(frozen=True)
class DrafterConfig(_HFConfig):
    """A DFlash (v1) / DFlash 2 block drafter; field names are the HF / z-lab ones (`dflash_config` flattened)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]    # target decoder layers whose output residual stream is tapped (0-indexed)
    mask_token_id: int                   # vocabulary row embedded for the B-1 masked block positions
    head_dim: int = 0                    # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 32768
    block_size: int = 16                 # training block size (serving may use a smaller one)
    sliding_window: int = 4096           # W: a block anchored at s sees context positions [max(0, s-W), s)
    conv_kernel_size: int = 2
    conv_group_size: int = 16            # channels sharing one dynamic conv coefficient
    selector_rank: int = 256
    selector_top_k: int = 16
    version: int = 2                     # 1 = DFlashDraftModel, 2 = DFlash2DraftModel

    def __post_init__(self) -> None:
        self._derive_head_dim()
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        self._validate()

    def _validate(self) -> None:
        self._check_shape(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers",
                          "max_position_embeddings", "block_size", "conv_group_size", "selector_rank", "selector_top_k"))
        for name in ("num_hidden_layers", "num_target_layers"):
            if getattr(self, name) > MAX_LAYERS:
                _fail(f"{name}={getattr(self, name)} is beyond any real model (at most {MAX_LAYERS:,}): a damaged "
                      "config?")
        if self.hidden_size % self.conv_group_size:
            _fail(f"conv_group_size={self.conv_group_size} does not divide hidden_size={self.hidden_size}")
        if self.conv_kernel_size != 2:
            _fail(f"conv_kernel_size={self.conv_kernel_size} is not supported (only 2)")
        if self.selector_top_k > self.vocab_size:
            _fail(f"selector_top_k={self.selector_top_k} exceeds vocab_size={self.vocab_size}")
        if not self.target_layer_ids:
            _fail("target_layer_ids must not be empty")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            _fail(f"target_layer_ids {list(self.target_layer_ids)} name a layer twice")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            _fail(f"target_layer_ids {bad} out of range [0, num_target_layers={self.num_target_layers})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            _fail(f"mask_token_id={self.mask_token_id} out of range [0, vocab_size={self.vocab_size})")
        if self.sliding_window < 1:
            _fail(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.version not in (1, 2):
            _fail(f"version must be 1 (DFlashDraftModel) or 2 (DFlash2DraftModel), got {self.version}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            _fail("rms_norm_eps and rope_theta must be positive")
        self._check_rope_scaling()

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def architecture(self) -> str:
        return "DFlash2DraftModel" if self.version == 2 else "DFlashDraftModel"

    # ---- pairing with a target --------------------------------------------------------------------------------
    @classmethod
    def for_target(cls, target: BeamConfig, **overrides: Any) -> DrafterConfig:
        """A drafter shaped like `target` (hidden size, heads, head_dim, vocab, RoPE, eps); any field can be overridden.

        Defaults: 5 layers (at most the target's), taps by DFlash's default rule, mask id = last vocab row,
        intermediate = the target's dense MLP width (3·hidden if it has none), W = min(4096, max positions),
        conv group 16 (1 if 16 does not divide hidden), selector rank min(256, hidden), top-k min(16, vocab).
        """
        layers = overrides.get("num_hidden_layers", min(5, target.num_hidden_layers))
        taps = overrides["target_layer_ids"] if "target_layer_ids" in overrides else default_target_layer_ids(
            target.num_hidden_layers, min(layers, target.num_hidden_layers))
        kwargs: dict[str, Any] = dict(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size or 3 * target.hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            num_target_layers=target.num_hidden_layers,
            target_layer_ids=tuple(taps),
            mask_token_id=target.vocab_size - 1,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            sliding_window=min(4096, target.max_position_embeddings),
            conv_group_size=16 if target.hidden_size % 16 == 0 else 1,
            selector_rank=min(256, target.hidden_size),
            selector_top_k=min(16, target.vocab_size),
        )
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            _fail(f"DrafterConfig.for_target: unknown field(s) {', '.join(unknown)}")
        kwargs.update(overrides)
        kwargs["target_layer_ids"] = tuple(taps)
        return cls(**kwargs)

    def check_target(self, target: BeamConfig) -> None:
        """Raise ConfigError if this drafter cannot run on `target` (vocab, tap width, tapped layers)."""
        if self.vocab_size != target.vocab_size:
            _fail(f"drafter vocab_size={self.vocab_size} != target vocab_size={target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            _fail(f"drafter fc expects taps of width {self.hidden_size} (hidden_size) but the target's hidden_size "
                  f"is {target.hidden_size}")
        if self.num_target_layers != target.num_hidden_layers:
            _fail(f"drafter num_target_layers={self.num_target_layers} != target num_hidden_layers="
                  f"{target.num_hidden_layers}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            _fail(f"drafter target_layer_ids {bad} out of range for a {target.num_hidden_layers}-layer target")

    # ---- Hugging Face config.json ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DrafterConfig:
        """Build from a DFlash / DFlash 2 config dict; unknown or mistyped fields fail with one line naming them."""
        raw = dict(raw)
        arch = raw.pop("architectures", None)
        known = [a for a in arch or [] if a in _DRAFTER_ARCHITECTURES] if isinstance(arch, list) else []
        if len(known) != 1:
            _fail(f"{source}: architectures must name one of {', '.join(_DRAFTER_ARCHITECTURES)}, got {arch!r}")
        kwargs: dict[str, Any] = {"version": _DRAFTER_ARCHITECTURES[known[0]]}
        dflash = raw.pop("dflash_config", None)
        if not isinstance(dflash, dict):
            _fail(f"{source}: dflash_config must be an object with mask_token_id and target_layer_ids, got {dflash!r}")
        unknown = sorted(k for k in dflash if k not in _DFLASH_SUBFIELDS)
        if unknown:
            _fail(f"{source}: unknown field(s) dflash_config.{', dflash_config.'.join(unknown)}")
        if "block_size" in dflash and "block_size" in raw and dflash["block_size"] != raw["block_size"]:
            _fail(f"{source}: block_size {raw['block_size']!r} != dflash_config.block_size {dflash['block_size']!r}")
        for name, value in dflash.items():
            raw.setdefault(name, value)
        window, use_window = raw.pop("sliding_window", None), raw.pop("use_sliding_window", None)
        layer_types = raw.pop("layer_types", None)
        if layer_types is not None:
            if not isinstance(layer_types, list) or len(set(layer_types)) > 1 or not set(layer_types) <= {
                    "sliding_attention", "full_attention"}:
                _fail(f"{source}: layer_types must be all 'sliding_attention' or all 'full_attention' "
                      f"(one window rule for every layer), got {layer_types!r}")
            if use_window is None:
                use_window = layer_types[:1] == ["sliding_attention"]
        for name, value in _DRAFTER_FIXED.items():
            if name in raw and raw.pop(name) != value:
                _fail(f"{source}: {name} must be {value!r} for a DFlash drafter")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in raw if (k not in fields or k == "version") and k not in _DRAFTER_IGNORED)
        if unknown:
            _fail(f"{source}: unknown field(s) {', '.join(unknown)}")
        for name, value in raw.items():
            if name not in fields or (name == "head_dim" and value is None):
                continue
            if name == "target_layer_ids":
                if not isinstance(value, list) or not all(_TYPE_CHECKS["int"](v) for v in value):
                    _fail(f"{source}: target_layer_ids must be a list of layer indices, got {value!r}")
                kwargs[name] = tuple(value)
            else:
                kwargs[name] = _check_type(source, name, value, fields[name].type)
        if use_window is False or (window is None and use_window is None):
            # Full attention over the context: a window as long as the model's context covers every position.
            kwargs["sliding_window"] = kwargs.get("max_position_embeddings", fields["max_position_embeddings"].default)
        elif window is None:
            _fail(f"{source}: use_sliding_window is true but sliding_window is missing")
        else:
            kwargs["sliding_window"] = _check_type(source, "sliding_window", window, "int")
        if "target_layer_ids" not in kwargs and "num_target_layers" in kwargs and "num_hidden_layers" in kwargs:
            kwargs["target_layer_ids"] = default_target_layer_ids(kwargs["num_target_layers"],
                                                                  kwargs["num_hidden_layers"])
        return cls._construct(kwargs, source)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"architectures": [self.architecture], "model_type": "qwen3"}
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                     "max_position_embeddings", "vocab_size", "num_target_layers", "block_size"):
            out[name] = getattr(self, name)
        out.update(hidden_act="silu", attention_bias=False, tie_word_embeddings=False, is_causal=False,
                   use_sliding_window=True, sliding_window=self.sliding_window,
                   layer_types=["sliding_attention"] * self.num_hidden_layers)
        out["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids),
                                "block_size": self.block_size}
        if self.version == 2:
            for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                out[name] = getattr(self, name)
        return out


MAX_CALIB_SAMPLES = 4096  # modelopt's LLM quantization examples default to 512
MAX_BLOCK_SIZE = 32  # the selector plugin walks at most 31 drafts


def check_block_size(block_size: int) -> None:
    """A verification block: the anchor and 1 to MAX_BLOCK_SIZE - 1 drafts."""
    if not 2 <= block_size <= MAX_BLOCK_SIZE:
        _fail(f"--block-size must be in [2, {MAX_BLOCK_SIZE}] (1 anchor + 1 to {MAX_BLOCK_SIZE - 1} drafts; the "
              f"selector plugin walks at most {MAX_BLOCK_SIZE - 1}), got {block_size}")


def drafter_block_error(block_size: int, drafter_block: int) -> str | None:
    """Why a drafter trained at blocks of `drafter_block` cannot draft blocks of `block_size`, or None: its block
    attends to every mask slot, so a larger block would change even its first drafts."""
    if block_size > drafter_block:
        return (f"--block-size {block_size} is above the drafter's own block ({drafter_block}), which it was trained "
                "on: use a block of at most that")
    return None


def check_draft_threshold(threshold: float) -> None:
    """A draft threshold: a probability (0 verifies whole blocks)."""
    if not 0 <= threshold <= 1:
        _fail(f"--draft-threshold must be in [0, 1] (0 verifies every draft of a block), got {threshold}")


@dataclass(frozen=True)
class EngineSettings:
    """Engine limits (build_engines.py --max-batch-size ...). The defaults size 4x B300 at concurrency up to 64."""

    max_batch_size: int = 64
    max_seq_len: int | None = None  # None: the target's max_position_embeddings (the build resolves it)
    max_num_tokens: int = 8192
    block_size: int = 8          # verified tokens per step: the target's max_draft_len = block_size - 1
    tensorrt_root: str = ""      # TensorRT headers for the plugin library ("" = $TRT_ROOT or /usr/local/tensorrt)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "max_num_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                _fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        check_block_size(self.block_size)
        if self.max_num_tokens < self.max_batch_size * self.block_size:
            _fail(f"--max-num-tokens {self.max_num_tokens} cannot hold one verify step of --max-batch-size "
                  f"{self.max_batch_size} x --block-size {self.block_size} tokens")

    def to_json(self) -> dict:
        return {"max_batch_size": self.max_batch_size, "max_seq_len": self.max_seq_len,
                "max_num_tokens": self.max_num_tokens, "block_size": self.block_size}


@dataclass(frozen=True)
class BuildConfig:
    """What build_engines.py builds: sources, precision, parallel layout, calibration, engine limits and output."""

    model: Path
    drafter: Path
    out: Path
    precision: str = "nvfp4"             # bf16 | fp8 | nvfp4
    tp: int = 4
    moe_ep: int = 1
    kv_cache: str = "auto"               # auto (the model dtype) | fp8
    calib_prompts: Path | None = None    # None = the packaged calibration prompts
    calib_samples: int = 32
    drafter_precision: str = "bf16"
    force: bool = False
    engine: EngineSettings = EngineSettings()

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp8", "nvfp4"):
            _fail(f"unknown precision {self.precision!r} (choose bf16, fp8 or nvfp4)")
        if self.kv_cache not in ("auto", "fp8"):
            _fail(f"unknown KV-cache precision {self.kv_cache!r} (choose auto or fp8)")
        if self.drafter_precision not in ("bf16", "fp8"):
            _fail(f"unknown drafter precision {self.drafter_precision!r} (choose bf16 or fp8)")
        if not 1 <= self.calib_samples <= MAX_CALIB_SAMPLES:  # all of them run through each layer, held in memory
            _fail(f"--calib-samples must be in [1, {MAX_CALIB_SAMPLES}], got {self.calib_samples}")
        from beamtrt.checkpoint.hf import holds

        sources = (("--model", self.model), ("--drafter", self.drafter), ("--calib-prompts", self.calib_prompts))
        for flag, src in sources:
            if src is None:
                continue
            if holds(self.out, src):
                _fail(f"--out {self.out} holds the {flag} input {src}: a build replaces its --out, so choose another")
            if holds(src, self.out):  # a checkpoint remade (make_beam_mini.py, train_drafter.py --force) replaces it
                _fail(f"--out {self.out} is inside the {flag} input {src}; choose another")

    @property
    def needs_calibration(self) -> bool:
        return self.precision != "bf16" or self.kv_cache == "fp8" or self.drafter_precision != "bf16"


GENERATION_CONFIG = "generation_config.json"


def generation_eos(folder: Path, vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids a checkpoint's generation_config.json names (a build keeps it in tokenizer/): Hugging
    Face's generate stops on them, and a chat model may name only there the token its turns end with (Qwen3 adds
    <|endoftext|> to config.json's <|im_end|>). () without the file or the field; a file that cannot be read as one
    is a CheckpointError (checked before any weight loads: hf_sources, and the build's Plan)."""
    file = Path(folder) / GENERATION_CONFIG
    if not file.exists():
        return ()
    from beamtrt.checkpoint.hf import read_json

    eos = read_json(file, GENERATION_CONFIG).get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise CheckpointError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    if bad := [i for i in ids if not 0 <= i < vocab_size]:
        raise CheckpointError(f"{file}: eos_token_id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return tuple(ids)
