"""TensorRT-LLM checkpoint name tables: every TP / EP split round-trips bit for bit, rank files load back to the
same logits, and what cannot be split fails with one clear message."""

from __future__ import annotations

import pytest
import torch

from beamtrt.checkpoint import trtllm
from beamtrt.checkpoint.trtllm_files import TrtllmCheckpoint, load_target, write_checkpoint
from beamtrt.config import BeamConfig, DrafterConfig
from beamtrt.errors import CheckpointError, ConfigError
from beamtrt.models.dflash2 import drafter_tensor_specs
from beamtrt.models.random_beam import random_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

# 8 query / 2 KV heads: KV heads are duplicated at TP 4 and 8; 8 experts split every moe_tp × moe_ep way.
SPLITTABLE = BeamConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
                        num_experts=8, num_experts_per_tok=2, mlp_only_layers=(1,), use_qk_norm=True)
SHARED = BeamConfig(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                    head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=False, use_qk_norm=False, qkv_bias=True, shared_expert_intermediate_size=64)
SPLITS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 8)]


def write(tmp_path, cfg, units, config, tensors, tp, precision="bf16", amax=None, warn=None):
    get = dict(tensors).__getitem__
    mapping = trtllm.Mapping(tp, config["mapping"]["moe_ep_size"])
    specs = trtllm.unit_specs(units, precision, torch.bfloat16)
    items = trtllm.produce(units, get, mapping, precision, torch.bfloat16, amax or {}, warn)
    write_checkpoint(tmp_path, config, specs, tp, items)
    return TrtllmCheckpoint(tmp_path)


@pytest.mark.parametrize("tp, ep", SPLITS)
def test_target_round_trip_bit_exact(tmp_path, tp, ep):
    tensors = dict(random_tensors(SPLITTABLE, seed=tp * 10 + ep))
    mapping = trtllm.Mapping(tp, ep)
    ckpt = write(tmp_path, SPLITTABLE, trtllm.target_units(SPLITTABLE, mapping),
                 trtllm.target_config(SPLITTABLE, mapping, "bf16", "auto", torch.bfloat16), tensors, tp)
    back = dict(ckpt.unshard())
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(back[name].to(t.dtype), t), name
    # each rank holds only its share: qkv rows = its query heads plus one (duplicated) KV head each for K and V
    qkv = ckpt.get(tp - 1, "transformer.layers.0.attention.qkv.weight")
    assert qkv.shape == ((8 // tp + 2 * max(2 // tp, 1)) * 16, 64)
    fc = ckpt.get(0, "transformer.layers.0.mlp.fc.weight")
    assert fc.shape == (8 // ep, 2 * 64 // (tp // ep), 64)


def test_kv_heads_duplicated_in_tensorrt_llm_order(tmp_path):
    """At TP 4 with 2 KV heads, ranks 0-1 hold KV head 0 and ranks 2-3 KV head 1 (TensorRT-LLM's dup_kv_weight)."""
    tensors = dict(random_tensors(SPLITTABLE))
    mapping = trtllm.Mapping(4)
    ckpt = write(tmp_path, SPLITTABLE, trtllm.target_units(SPLITTABLE, mapping),
                 trtllm.target_config(SPLITTABLE, mapping, "bf16", "auto", torch.bfloat16), tensors, 4)
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    for rank in range(4):
        qkv = ckpt.get(rank, "transformer.layers.0.attention.qkv.weight")
        assert torch.equal(qkv[32:48], k[16 * (rank // 2):16 * (rank // 2 + 1)])
    up, gate = (tensors[f"model.layers.0.mlp.experts.3.{p}_proj.weight"] for p in ("up", "gate"))
    fc = ckpt.get(1, "transformer.layers.0.mlp.fc.weight")[3]  # moe_tp rank 1 of 4: rows 16:32 of up, then gate
    assert torch.equal(fc, torch.cat((up[16:32], gate[16:32])))
    up, gate = (tensors[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("up", "gate"))  # the dense layer's GatedMLP:
    for rank in range(4):  # fc is gate_proj (the activated half), gate is up_proj, as TensorRT-LLM's converters
        rows = slice(32 * rank, 32 * (rank + 1))
        assert torch.equal(ckpt.get(rank, "transformer.layers.1.mlp.fc.weight"), gate[rows])
        assert torch.equal(ckpt.get(rank, "transformer.layers.1.mlp.gate.weight"), up[rows])


def test_shared_expert_and_bias_round_trip(tmp_path):
    tensors = dict(random_tensors(SHARED, seed=3))
    mapping = trtllm.Mapping(2, 2)
    assert trtllm.target_architecture(SHARED) == ("Qwen2MoeForCausalLM", "qwen2_moe")
    config = trtllm.target_config(SHARED, mapping, "bf16", "auto", torch.bfloat16)
    assert config["moe"]["normalization_mode"] == 0  # no top-k renormalization (norm_topk_prob false): NONE
    ckpt = write(tmp_path, SHARED, trtllm.target_units(SHARED, mapping), config, tensors, 2)
    back = dict(ckpt.unshard())
    for name, t in tensors.items():
        assert torch.equal(back[name].to(t.dtype), t), name
    up, gate = (tensors[f"model.layers.0.mlp.shared_expert.{p}_proj.weight"] for p in ("up", "gate"))
    for rank in range(2):  # [up; gate] per rank, as the routed experts' fc (a round trip cannot see the order)
        fc = ckpt.get(rank, "transformer.layers.0.mlp.shared_expert.fc.weight")
        assert torch.equal(fc, torch.cat((up[32 * rank:32 * (rank + 1)], gate[32 * rank:32 * (rank + 1)])))


def test_converted_target_gives_identical_logits(tmp_path):
    from beamtrt.models.beam import BeamForCausalLM, load_state

    tensors = dict(random_tensors(SPLITTABLE, seed=5))
    ref = BeamForCausalLM(SPLITTABLE)
    load_state(ref, tensors.items())
    mapping = trtllm.Mapping(4, 2)
    write(tmp_path, SPLITTABLE, trtllm.target_units(SPLITTABLE, mapping),
          trtllm.target_config(SPLITTABLE, mapping, "bf16", "auto", torch.bfloat16), tensors, 4)
    model = load_target(tmp_path)
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids, model.new_cache(2, 16)).logits, ref.eval()(ids, ref.new_cache(2, 16)).logits)


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_an_all_zero_expert_quantizes_to_zeros(tmp_path, precision):
    """A pruned expert (its down_proj all zeros) and a zeroed dense MLP (gate and up, which share a scale) get the
    scale of modelopt's zero-amax rule (amax = the format's largest value) instead of failing the build on a zero
    scale, are named in a warning each, and load back as zeros."""
    tensors = dict(random_tensors(SPLITTABLE, seed=4))
    dense = [f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up")]
    for name in ("model.layers.0.mlp.experts.5.down_proj.weight", *dense):
        tensors[name].zero_()
    mapping = trtllm.Mapping(2)
    ranges = {f"transformer.layers.{i}.{site}": 3.0 for i in range(2)
              for site in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.proj")}
    warned: list[str] = []
    ckpt = write(tmp_path, SPLITTABLE, trtllm.target_units(SPLITTABLE, mapping),
                 trtllm.target_config(SPLITTABLE, mapping, precision, "auto", torch.bfloat16), tensors, 2, precision,
                 ranges, warned.append)
    assert [line.split(": all zeros")[0] for line in warned] == [
        "warning: model.layers.0.mlp.experts.5.down_proj.weight", *(f"warning: {name}" for name in dense)]
    name = "transformer.layers.0.mlp.proj.weights_scaling_factor" + ("" if precision == "fp8" else "_2")
    assert float(ckpt.get(1, name)[5]) == float(torch.tensor(1.0 if precision == "fp8" else 1 / 448))  # fp32
    model = load_target(tmp_path)
    assert not model.layers[0].mlp.w_down[5].any() and model.layers[0].mlp.w_down[4].any()
    assert not model.layers[1].mlp.gate_up.weight.any()


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_ranges_at_the_edges_of_fp32(precision):
    """modelopt's export rules for ranges: a zero activation range takes the format's largest value (fp8 scale 1.0,
    NVFP4 1/448: it was a zero scale), a positive range is at least fp32's smallest normal (a weight of 1e-44 made a
    zero scale, refused by the quantizer with no tensor named), and a NaN weight is refused by name (it was warned of
    as all zeros)."""
    assert float(trtllm.act_scale(precision, 0.0)) == float(torch.tensor(1.0 if precision == "fp8" else 1 / 448))
    tiny = torch.finfo(torch.float32).tiny
    assert float(trtllm.act_scale(precision, 1e-44)) == float(trtllm.act_scale(precision, tiny)) > 0
    weight = torch.full((4, 32), 1e-44)
    assert float(trtllm._weight_amax([weight], ["w.weight"], precision, None)) == tiny
    weight[1, 3] = float("nan")
    with pytest.raises(CheckpointError, match=r"^v.weight, w.weight: NaN or Inf values cannot be quantized$"):
        trtllm._weight_amax([torch.ones(2, 32), weight], ["v.weight", "w.weight"], precision, None)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_drafter_round_trip_bit_exact(tmp_path, tp):
    cfg = DrafterConfig.for_target(SPLITTABLE, num_hidden_layers=2, target_layer_ids=(0, 1), mask_token_id=0)
    gen = torch.Generator().manual_seed(tp)
    tensors = {n: torch.randn(shape, generator=gen).to(torch.bfloat16)
               for n, (shape, _, _) in drafter_tensor_specs(cfg).items()}
    mapping = trtllm.Mapping(tp)
    ckpt = write(tmp_path, cfg, trtllm.drafter_units(cfg, mapping), trtllm.drafter_config(cfg, mapping, torch.bfloat16),
                 tensors, tp)
    assert ckpt.is_drafter() and ckpt.drafter_config() == cfg
    back = dict(ckpt.unshard())
    assert set(back) == set(tensors)  # no embedding, no LM head: the drafter uses the target's
    for name, t in tensors.items():
        assert torch.equal(back[name].to(t.dtype), t), name
    assert ckpt.get(0, "candidate_selector.predecessor_codebook").shape == (120 // tp, cfg.selector_rank)


def test_vocab_padded_to_a_multiple_of_tp(tmp_path):
    cfg = BeamConfig.from_dict({**SPLITTABLE.to_dict(), "vocab_size": 119})
    tensors = dict(random_tensors(cfg))
    mapping = trtllm.Mapping(4)
    ckpt = write(tmp_path, cfg, trtllm.target_units(cfg, mapping),
                 trtllm.target_config(cfg, mapping, "bf16", "auto", torch.bfloat16), tensors, 4)
    last = ckpt.get(3, "lm_head.weight")
    assert last.shape == (30, 64) and torch.equal(last[-1], torch.zeros(64, dtype=torch.bfloat16))
    assert torch.equal(dict(ckpt.unshard())["lm_head.weight"], tensors["lm_head.weight"])


@pytest.mark.parametrize("tp, ep, message", [
    (3, 1, "does not divide the target's 8 attention heads"),
    (4, 3, "--moe-ep 3 must divide --tp 4"),
    (16, 1, "does not divide the target's 8 attention heads"),
])
def test_unsplittable_layouts_fail_clearly(tp, ep, message):
    with pytest.raises(ConfigError, match=message):
        trtllm.target_units(SPLITTABLE, trtllm.Mapping(tp, ep))


@pytest.mark.parametrize("raw", [{"tp_size": 0}, {"tp_size": 4, "moe_ep_size": 3}, {"tp_size": "x"}, {}])
def test_a_bad_mapping_in_a_checkpoint_names_the_file_not_a_flag(raw):
    with pytest.raises(CheckpointError, match=r"^ckpt/config.json: 'mapping' ") as info:
        trtllm.Mapping.from_json(raw, "ckpt/config.json")
    assert "--" not in str(info.value)


def test_too_many_expert_ways_fail_clearly():
    cfg = BeamConfig.from_dict({**SPLITTABLE.to_dict(), "num_experts": 6})
    with pytest.raises(ConfigError, match=r"number of experts with moe_ep 4 \(6\) is not divisible by 4"):
        trtllm.target_units(cfg, trtllm.Mapping(4, 4))


def test_architecture_choice():
    assert trtllm.target_architecture(SPLITTABLE) == ("Qwen3MoeForCausalLM", "qwen3_moe")
    mini_like = BeamConfig.from_dict({**SPLITTABLE.to_dict(), "use_qk_norm": False, "mlp_only_layers": []})
    assert trtllm.target_architecture(mini_like) == ("MixtralForCausalLM", None)
    config = trtllm.target_config(mini_like, trtllm.Mapping(4, 2), "nvfp4", "fp8", torch.bfloat16)
    assert config["mapping"] == {"world_size": 4, "tp_size": 4, "pp_size": 1, "cp_size": 1, "moe_tp_size": 2,
                                 "moe_ep_size": 2}
    assert config["quantization"]["quant_algo"] == "NVFP4" and config["quantization"]["group_size"] == 16
    assert config["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert config["moe"] == {"num_experts": 8, "top_k": 2, "normalization_mode": 1,
                             "shared_expert_intermediate_size": 0}
    assert "transformer.layers.0.mlp.router" in config["quantization"]["exclude_modules"]
    assert config["moe_intermediate_size"] == 64 and config["intermediate_size"] == 64  # Mixtral: expert size
    assert (config["rotary_base"], config["rotary_scaling"]) == (SPLITTABLE.rope_theta, None)
    scaled = BeamConfig.from_dict({**SPLITTABLE.to_dict(), "rope_theta": 5e5,
                                   "rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    config = trtllm.target_config(scaled, trtllm.Mapping(1), "bf16", "auto", torch.bfloat16)
    assert (config["rotary_base"], config["rotary_scaling"]) == (5e5, {"rope_type": "linear", "factor": 4.0})


def test_fp8_kv_cache_emulated_from_its_scale(tmp_path):
    """With kv_cache_quant_algo FP8 the reference model stores K and V on the E4M3 grid of kv_cache_scaling_factor
    (max of the k and v scales, each at least 1.0 as modelopt's export writes them)."""
    tensors = dict(random_tensors(SPLITTABLE, seed=2))
    mapping = trtllm.Mapping(2)
    units = trtllm.target_units(SPLITTABLE, mapping)
    amax = {f"transformer.layers.{i}.attention.{kind}_cache": a for i in range(2)
            for kind, a in (("k", 900.0), ("v", 300.0))}
    specs = trtllm.unit_specs(units, "bf16", torch.bfloat16, "fp8", 2)
    kv = [(r, n, t, None) for n, t in trtllm.kv_cache_scales(2, amax) for r in range(2)]
    items = list(trtllm.produce(units, tensors.__getitem__, mapping, "bf16", torch.bfloat16, {})) + kv
    write_checkpoint(tmp_path, trtllm.target_config(SPLITTABLE, mapping, "bf16", "fp8", torch.bfloat16), specs, 2,
                     items)
    ckpt = TrtllmCheckpoint(tmp_path)
    assert float(ckpt.get(1, "transformer.layers.0.attention.v_cache_scaling_factor")) == 1.0  # 300/448 -> 1.0
    scale = float(ckpt.get(0, "transformer.layers.0.attention.kv_cache_scaling_factor"))
    assert scale == pytest.approx(900 / 448)
    model = load_target(tmp_path)
    cache = model.new_cache(1, 8)
    model(torch.arange(8)[None], cache)
    k = cache.k[0, 0, :, :8]
    assert k.abs().sum() > 0 and torch.equal((k / scale).to(torch.float8_e4m3fn).float() * scale, k)


@pytest.mark.parametrize("config, needle", [
    ({"quantization": "FP8"}, "'quantization' must be a JSON object, got str"),
    ({"mapping": {"tp_size": 1}, "beam_config": [1]}, "'beam_config' must be a JSON object, got list"),
    ({"mapping": {"tp_size": 1}, "architecture": trtllm.DRAFTER_ARCHITECTURE, "dtype": "bfloat16"},
     "without its drafter_config"),
    # a traceback (int(None)), a message naming no file (int("x")), a tp_size read as 2, an unhashable algorithm
    ({"mapping": {"tp_size": 2, "pp_size": None}}, "'mapping' needs integer .*, got pp_size None"),
    ({"mapping": {"tp_size": 2, "moe_tp_size": "x"}}, "'mapping' needs integer .*, got moe_tp_size 'x'"),
    ({"mapping": {"tp_size": 2.9}}, "'mapping' needs integer .*, got tp_size 2.9"),
    ({"mapping": {"tp_size": True}}, "'mapping' needs integer .*, got tp_size True"),
    ({"mapping": {"tp_size": 1}, "quantization": {"quant_algo": ["FP8"]}}, r"unsupported quant_algo \['FP8'\]"),
])
def test_a_checkpoint_config_of_the_wrong_shape_is_one_line(tmp_path, config, needle):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=needle) as info:
        TrtllmCheckpoint(tmp_path).units()
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: ")


def test_a_directory_in_place_of_a_rank_file_is_named(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"mapping": {"tp_size": 1}, "dtype": "bfloat16"}))
    (tmp_path / "rank0.safetensors").mkdir()  # was 'missing rank file (the checkpoint has tp_size 1)'
    with pytest.raises(CheckpointError, match="rank0.safetensors: a directory, not a rank file$"):
        TrtllmCheckpoint(tmp_path).open(0)


def test_an_interrupt_while_rank_files_are_synced_leaves_nothing_and_stays_an_interrupt(tmp_path, monkeypatch):
    """Ctrl-C while the second rank file is being synced: the first is already closed, and aborting must not close
    its descriptor again (that raised EBADF in place of the interrupt, or could close another file's descriptor)."""
    import os

    from beamtrt.checkpoint import stream

    specs = {"w": ((2, 3), torch.float32)}
    items = [(r, "w", torch.ones(2, 3), None) for r in range(2)]
    real, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(fd)

    monkeypatch.setattr(stream.os, "fsync", fsync)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, {}, specs, 2, items)
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []
