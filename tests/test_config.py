"""Tests for beamtrt.config.BeamConfig: HF config.json round trips, validation errors, MoE layer layout."""

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from beamtrt.config import BeamConfig
from beamtrt.errors import BeamtrtError, CheckpointError, ConfigError

# A small valid HF-style config: 4 layers, layer 1 dense, the rest MoE.
BASE = {
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
}

SMALL_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


def config_error(raw: dict, *needles: str) -> str:
    """from_dict(raw) must raise a one-line ConfigError containing every needle."""
    with pytest.raises(ConfigError) as info:
        BeamConfig.from_dict(raw)
    msg = str(info.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def with_(**changes) -> dict:
    return {**BASE, **changes}


def without(key: str) -> dict:
    return {k: v for k, v in BASE.items() if k != key}


# ---- round trips ----------------------------------------------------------------------------------------------

FULL = BeamConfig(
    vocab_size=200, hidden_size=48, num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=3,
    intermediate_size=80, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3, head_dim=10,
    norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=(0, 4), shared_expert_intermediate_size=40,
    rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=4096, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 1024},
    use_qk_norm=False, attention_bias=True, qkv_bias=True, logit_scale=0.25, final_logit_softcapping=30.0,
    bos_token_id=1, eos_token_id=[2, 3],
)


@pytest.mark.parametrize("cfg", [BeamConfig.from_dict(BASE), FULL], ids=["base", "every-field-set"])
def test_dict_round_trip(cfg: BeamConfig) -> None:
    d = cfg.to_dict()
    assert d["model_type"] == "qwen3_moe"
    back = BeamConfig.from_dict(d)
    assert back == cfg
    assert back.to_dict() == d
    json.dumps(d)  # plain JSON types only


def test_every_field_differs_from_default_in_full() -> None:
    """FULL really exercises every field's round trip (none silently left at its default)."""
    for f in dataclasses.fields(BeamConfig):
        if f.default is not dataclasses.MISSING and f.name != "hidden_act":  # only "silu" is supported
            assert getattr(FULL, f.name) != f.default, f.name


@pytest.mark.parametrize("cfg", [BeamConfig.from_dict(BASE), FULL], ids=["base", "every-field-set"])
def test_save_and_from_file_round_trip(tmp_path: Path, cfg: BeamConfig) -> None:
    cfg.save(tmp_path)  # a directory -> <dir>/config.json
    assert (tmp_path / "config.json").is_file()
    assert BeamConfig.from_file(tmp_path) == cfg
    assert BeamConfig.from_file(tmp_path / "config.json") == cfg
    other = tmp_path / "other.json"
    cfg.save(other)  # a file path
    assert BeamConfig.from_file(other) == cfg
    assert list(tmp_path.glob("*.tmp")) == []  # atomic write left no temp files


def test_a_config_json_that_is_a_folder_is_named_as_one(tmp_path: Path) -> None:
    """It read '.../config.json/config.json: missing config.json'."""
    (tmp_path / "config.json").mkdir()
    for path in (tmp_path, tmp_path / "config.json"):
        with pytest.raises(CheckpointError, match=f"^{tmp_path / 'config.json'}: a directory, not config.json$"):
            BeamConfig.from_file(path)


def test_frozen() -> None:
    cfg = BeamConfig.from_dict(BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 32  # type: ignore[misc]


def _hf_dicts(hf_cfg, tmp_path: Path) -> list[dict]:
    hf_cfg.save_pretrained(tmp_path)
    return [hf_cfg.to_dict(), hf_cfg.to_diff_dict(), json.loads((tmp_path / "config.json").read_text())]


@pytest.mark.parametrize("form", range(3), ids=["to_dict", "to_diff_dict", "save_pretrained"])
def test_qwen3_moe_hf_config_parses(tmp_path: Path, form: int) -> None:
    hf_cfg = Qwen3MoeConfig(**SMALL_HF, head_dim=24, mlp_only_layers=[0, 2], decoder_sparse_step=1,
                            norm_topk_prob=True, attention_bias=True, tie_word_embeddings=True, rope_theta=1e6,
                            rope_scaling={"rope_type": "linear", "factor": 2.0}, rms_norm_eps=1e-5,
                            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
    cfg = BeamConfig.from_dict(_hf_dicts(hf_cfg, tmp_path)[form])
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (128, 64, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 24)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (96, 32, 8, 2)
    assert cfg.mlp_only_layers == (0, 2) and cfg.norm_topk_prob is True
    assert cfg.attention_bias is True and cfg.qkv_bias is False and cfg.use_qk_norm is True
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 2048
    assert cfg.rope_scaling["factor"] == 2.0
    assert cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type")) == "linear"
    assert cfg.shared_expert_intermediate_size == 0
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


@pytest.mark.parametrize("form", range(3), ids=["to_dict", "to_diff_dict", "save_pretrained"])
def test_qwen3_moe_hf_defaults_parse(tmp_path: Path, form: int) -> None:
    """The stock Qwen3MoeConfig (no head_dim field, norm_topk_prob False) parses; head_dim is derived."""
    cfg = BeamConfig.from_dict(_hf_dicts(Qwen3MoeConfig(), tmp_path)[form])
    assert cfg.head_dim == 2048 // 32
    assert cfg.norm_topk_prob is False and cfg.use_qk_norm is True and cfg.qkv_bias is False
    assert cfg.num_experts == 128 and cfg.num_experts_per_tok == 8 and cfg.mlp_only_layers == ()


@pytest.mark.parametrize("form", range(3), ids=["to_dict", "to_diff_dict", "save_pretrained"])
def test_qwen2_moe_hf_config_parses(tmp_path: Path, form: int) -> None:
    hf_cfg = Qwen2MoeConfig(**SMALL_HF, shared_expert_intermediate_size=48, decoder_sparse_step=2)
    raw = _hf_dicts(hf_cfg, tmp_path)[form]
    assert "head_dim" not in raw and "use_qk_norm" not in raw
    cfg = BeamConfig.from_dict(raw)
    assert cfg.use_qk_norm is False and cfg.qkv_bias is True and cfg.attention_bias is False  # Qwen2 family
    assert cfg.shared_expert_intermediate_size == 48 and cfg.decoder_sparse_step == 2
    assert cfg.head_dim == 16  # derived
    # And it survives our own round trip (written as qwen3_moe with the family fields explicit).
    assert BeamConfig.from_dict(cfg.to_dict()) == cfg


def test_qwen2_family_defaults_without_qkv_bias_field() -> None:
    raw = with_(model_type="qwen2_moe")
    cfg = BeamConfig.from_dict(raw)
    assert cfg.use_qk_norm is False and cfg.qkv_bias is True
    cfg = BeamConfig.from_dict(with_(model_type="qwen2_moe", qkv_bias=False))
    assert cfg.qkv_bias is False  # an explicit field beats the family default
    cfg = BeamConfig.from_dict(BASE)
    assert cfg.use_qk_norm is True and cfg.qkv_bias is False


@pytest.mark.parametrize("raw_head_dim", ["absent", None])
def test_head_dim_derived_when_absent(raw_head_dim) -> None:
    raw = with_(hidden_size=96) if raw_head_dim == "absent" else with_(hidden_size=96, head_dim=None)
    cfg = BeamConfig.from_dict(raw)
    assert cfg.head_dim == 96 // 4 and cfg.q_size == 96 and cfg.kv_size == 48
    cfg = BeamConfig.from_dict(with_(head_dim=10))  # explicit, not hidden/heads
    assert cfg.head_dim == 10 and cfg.q_size == 40 and cfg.kv_size == 20


def test_missing_model_type_means_qwen3() -> None:
    cfg = BeamConfig.from_dict(without("model_type"))
    assert cfg.use_qk_norm is True and cfg.qkv_bias is False


def test_int_accepted_for_float_fields() -> None:
    cfg = BeamConfig.from_dict(with_(rope_theta=10000, rms_norm_eps=1, logit_scale=2))
    assert isinstance(cfg.rope_theta, float) and cfg.rope_theta == 10000.0
    assert isinstance(cfg.logit_scale, float)


# ---- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, needles", [
    (with_(foo_bar=1), ["unknown field", "foo_bar"]),
    (with_(hidden_size=66), ["num_attention_heads=4", "hidden_size=66", "head_dim"]),
    (with_(num_key_value_heads=3), ["num_key_value_heads=3", "num_attention_heads=4"]),
    (with_(num_experts_per_tok=9), ["num_experts_per_tok=9", "num_experts=8"]),
    (with_(num_experts_per_tok=0), ["num_experts_per_tok=0"]),
    (with_(mlp_only_layers=[4]), ["mlp_only_layers", "[4]", "out of range"]),
    (with_(mlp_only_layers=[-1]), ["mlp_only_layers", "[-1]", "out of range"]),
    (with_(mlp_only_layers=1), ["mlp_only_layers", "list"]),
    (with_(mlp_only_layers="0,1"), ["mlp_only_layers", "list"]),
    (with_(mlp_only_layers=[0.0]), ["mlp_only_layers", "list"]),
    (with_(hidden_size="64"), ["hidden_size", "int", "'64'"]),
    (with_(num_hidden_layers=True), ["num_hidden_layers", "int", "True"]),
    (with_(num_experts=8.0), ["num_experts", "int", "8.0"]),
    (with_(norm_topk_prob=1), ["norm_topk_prob", "bool"]),
    (with_(rope_theta="1e4"), ["rope_theta", "float"]),
    (with_(hidden_act=None), ["hidden_act"]),
    (with_(rope_scaling="linear"), ["rope_scaling"]),
    (without("vocab_size"), ["missing", "vocab_size"]),
    (without("num_experts_per_tok"), ["missing", "num_experts_per_tok"]),
    (with_(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["rope_scaling", "yarn"]),
    (with_(rope_scaling={"type": "dynamic", "factor": 4.0}), ["rope_scaling", "dynamic"]),
    (with_(rope_scaling={"type": "linear"}), ["rope_scaling", "'linear'", "needs factor", "None"]),
    (with_(rope_scaling={"rope_type": ["llama3"]}), ["rope_scaling type ['llama3'] is not supported"]),
    (with_(rope_scaling={"rope_type": "linear", "factor": "x"}), ["needs factor", "'x'"]),
    (with_(rope_scaling={"rope_type": "linear", "factor": 0}), ["needs factor", "got 0"]),
    (with_(rope_scaling={"rope_type": "llama3", "factor": 8}), ["'llama3'", "needs low_freq_factor"]),
    (with_(rope_scaling={**FULL.rope_scaling, "original_max_position_embeddings": True}),
     ["original_max_position_embeddings", "True"]),
    (with_(rope_scaling={**FULL.rope_scaling, "high_freq_factor": 1.0}), ["high_freq_factor 1.0", "low_freq_factor"]),
    (with_(hidden_act="gelu"), ["hidden_act", "gelu"]),
    (with_(model_type="llama"), ["model_type", "llama"]),
    (with_(use_sliding_window=True), ["sliding"]),
    (with_(vocab_size=-1), ["vocab_size", "-1"]),
    (with_(hidden_size=-64), ["hidden_size", "-64"]),
    (with_(num_hidden_layers=0, mlp_only_layers=[]), ["num_hidden_layers", "0"]),
    (with_(num_attention_heads=-4, num_key_value_heads=-2), ["num_attention_heads", "-4"]),
    (with_(num_key_value_heads=-2), ["num_key_value_heads", "-2"]),
    (with_(head_dim=-16), ["head_dim", "-16"]),
    (with_(head_dim=15), ["head_dim=15", "even"]),
    (with_(intermediate_size=-96), ["intermediate_size", "-96"]),
    (with_(intermediate_size=-96, mlp_only_layers=[]), ["intermediate_size", "-96"]),  # no dense layer at all
    (with_(moe_intermediate_size=-32), ["moe_intermediate_size", "-32"]),
    (with_(num_experts=-8), ["num_experts"]),
    (with_(num_experts=0, num_experts_per_tok=-2), ["num_experts_per_tok", "-2"]),
    (with_(shared_expert_intermediate_size=-48), ["shared_expert_intermediate_size"]),
    (with_(decoder_sparse_step=0), ["decoder_sparse_step", "0"]),
    (with_(max_position_embeddings=-1), ["max_position_embeddings", "-1"]),
    (with_(rms_norm_eps=0.0), ["rms_norm_eps"]),
    (with_(rope_theta=-1.0), ["rope_theta"]),
    (with_(final_logit_softcapping=0.0), ["final_logit_softcapping", "0.0"]),
    (with_(final_logit_softcapping=-30.0), ["final_logit_softcapping", "-30.0"]),
    (with_(logit_scale=float("inf")), ["logit_scale"]),
    (with_(eos_token_id=10**9), ["eos_token_id", "1000000000", "vocabulary"]),
    (with_(eos_token_id=[2, -1]), ["eos_token_id", "[2, -1]", "vocabulary"]),
    (with_(eos_token_id=[2, "3"]), ["eos_token_id", "int"]),
    (with_(num_hidden_layers=10**12), ["num_hidden_layers=1000000000000", "beyond any real model"]),
    (with_(num_hidden_layers=10_001, num_experts=0, mlp_only_layers=[]), ["num_hidden_layers=10001", "beyond"]),
    (with_(num_experts=10**9, num_experts_per_tok=2), ["num_experts=1000000000", "beyond any real model"]),
], ids=lambda v: None if isinstance(v, dict) else "-".join(v)[:40])
def test_bad_config_one_line_error(raw: dict, needles: list[str]) -> None:
    msg = config_error(raw, *needles)
    assert msg.startswith("config.json: "), msg  # names the source


def test_bad_config_direct_constructor_errors() -> None:
    """The dataclass validates itself too (not only from_dict)."""
    good = BeamConfig.from_dict(BASE)
    for changes, needle in [({"num_experts_per_tok": 0}, "num_experts_per_tok"),
                            ({"final_logit_softcapping": 0.0}, "final_logit_softcapping"),
                            ({"mlp_only_layers": (7,)}, "mlp_only_layers"),
                            ({"hidden_act": "relu"}, "hidden_act")]:
        with pytest.raises(ConfigError, match=needle) as info:
            dataclasses.replace(good, **changes)
        assert "\n" not in str(info.value)


def test_source_named_in_error() -> None:
    with pytest.raises(ConfigError, match=r"^/some/where/config\.json: .*foo_bar"):
        BeamConfig.from_dict(with_(foo_bar=1), source="/some/where/config.json")


def test_from_file_bad_field_names_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(with_(num_experts_per_tok=99)))
    with pytest.raises(ConfigError) as info:
        BeamConfig.from_file(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path / "config.json") in msg and "num_experts_per_tok=99" in msg


@pytest.mark.parametrize("content, needle", [
    (json.dumps(BASE)[:-20], "not valid JSON"),  # truncated
    ("", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (json.dumps([BASE]), "JSON object"),
], ids=["truncated", "empty", "binary", "list"])
def test_from_file_corrupt_config(tmp_path: Path, content, needle: str) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for arg in (tmp_path, path):
        with pytest.raises(BeamtrtError) as info:
            BeamConfig.from_file(arg)
        assert isinstance(info.value, (CheckpointError, ConfigError))
        msg = str(info.value)
        assert "\n" not in msg and str(path) in msg and needle in msg, msg


def test_from_file_missing_config(tmp_path: Path) -> None:
    for arg in (tmp_path, tmp_path / "config.json"):
        with pytest.raises(BeamtrtError) as info:
            BeamConfig.from_file(arg)
        assert isinstance(info.value, (CheckpointError, ConfigError))
        msg = str(info.value)
        assert msg == f"{tmp_path}: no config.json", msg


# ---- MoE layer layout -------------------------------------------------------------------------------------------

def _hf_rule(i: int, mlp_only_layers, num_experts: int, step: int) -> bool:
    return (i not in mlp_only_layers) and num_experts > 0 and (i + 1) % step == 0


@pytest.mark.parametrize("layers, mlp_only, experts, step", [
    (4, [], 8, 1), (4, [1], 8, 1), (6, [], 8, 2), (6, [0, 3], 8, 2), (7, [2, 5, 6], 4, 3),
    (5, [0, 1, 2, 3, 4], 4, 1), (4, [], 0, 1), (4, [2], 0, 2), (8, [7], 8, 4), (3, [], 8, 5),
])
def test_is_moe_layer_matches_transformers(layers: int, mlp_only: list[int], experts: int, step: int) -> None:
    raw = with_(num_hidden_layers=layers, mlp_only_layers=mlp_only, num_experts=experts, decoder_sparse_step=step)
    cfg = BeamConfig.from_dict(raw)
    got = [cfg.is_moe_layer(i) for i in range(layers)]
    assert got == [_hf_rule(i, mlp_only, experts, step) for i in range(layers)]


@pytest.mark.parametrize("mlp_only, step", [([1], 1), ([], 2), ([3], 2)])
def test_is_moe_layer_matches_hf_model_layout(mlp_only: list[int], step: int) -> None:
    """Against the layer classes transformers actually builds (tiny model, so cheap)."""
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = Qwen3MoeConfig(**{**SMALL_HF, "hidden_size": 16, "intermediate_size": 8, "moe_intermediate_size": 8,
                               "num_experts": 2, "num_experts_per_tok": 1},
                            mlp_only_layers=mlp_only, decoder_sparse_step=step)
    hf = Qwen3MoeForCausalLM(hf_cfg)
    cfg = BeamConfig.from_dict(hf_cfg.to_dict())
    hf_moe = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == hf_moe
    assert any(hf_moe) and not all(hf_moe)
