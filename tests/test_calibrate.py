"""Layer-by-layer calibration records the ranges nvidia-modelopt's max calibration records on the same model and
data, at every site (GEMM inputs, routed experts, K / V after RoPE), and the prompt file parser rejects bad files."""

from __future__ import annotations

import warnings

import pytest
import torch

from beamtrt.checkpoint.hf import save_state_dict
from beamtrt.config import BeamConfig
from beamtrt.quant import calibrate as cal

pytestmark = pytest.mark.usefixtures("one_thread")


def test_ranges_equal_modelopt_max_calibration(tmp_path):
    pytest.importorskip("modelopt")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.nn import TensorQuantizer

    from modelopt_ref import quant_config, tiny_qwen3_moe

    hf = tiny_qwen3_moe(seed=7, dtype=torch.float32, mlp_only_layers=[1])
    cfg = BeamConfig.from_dict(hf.config.to_dict())
    save_state_dict(tmp_path, hf.state_dict())
    cfg.save(tmp_path / "config.json")
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 256, (n,), generator=gen) for n in (5, 17, 9, 30)]

    ours = cal.calibrate(tmp_path, cfg, sequences).amax

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        mtq.quantize(hf, quant_config("FP8_DEFAULT_CFG", kv_fp8=True), lambda m: [m(s[None]) for s in sequences])
    amax = {n: float(m.amax.max()) for n, m in hf.named_modules()
            if isinstance(m, TensorQuantizer) and m.is_enabled and m.amax is not None and "weight" not in n}
    theirs: dict[str, float] = {}
    for i in range(cfg.num_hidden_layers):
        hf_, trt = f"model.layers.{i}.", f"transformer.layers.{i}."
        theirs[trt + "attention.qkv"] = amax[hf_ + "self_attn.q_proj.input_quantizer"]
        theirs[trt + "attention.dense"] = amax[hf_ + "self_attn.o_proj.input_quantizer"]
        theirs[trt + "attention.k_cache"] = amax[hf_ + "self_attn.k_bmm_quantizer"]
        theirs[trt + "attention.v_cache"] = amax[hf_ + "self_attn.v_bmm_quantizer"]
        if cfg.is_moe_layer(i):  # modelopt syncs every expert's input range to the layer's max
            theirs[trt + "mlp.fc"] = max(amax[hf_ + f"mlp.experts.{e}.gate_proj.input_quantizer"] for e in range(4))
            theirs[trt + "mlp.proj"] = max(amax[hf_ + f"mlp.experts.{e}.down_proj.input_quantizer"] for e in range(4))
        else:
            theirs[trt + "mlp.fc"] = amax[hf_ + "mlp.gate_proj.input_quantizer"]
            theirs[trt + "mlp.proj"] = amax[hf_ + "mlp.down_proj.input_quantizer"]
    assert set(ours) == set(theirs)
    for site, value in theirs.items():
        assert ours[site] == pytest.approx(value, rel=1e-5), site


def test_packaged_prompts_parse():
    from beamtrt.prompts import read_chat_lines

    chats = [chat for _, chat in read_chat_lines(cal.default_prompts_path())]
    assert len(chats) >= 32 and all(c[0]["role"] == "user" and c[0]["content"] for c in chats)


def test_an_activation_range_that_met_a_nan_stays_nan():
    """max(0.0, nan) is 0.0: a NaN activation was reported as 'amax 0.0' (a range of zeros), not as the NaN it was."""
    import math

    from beamtrt.quant.calibrate import _Observer

    obs = _Observer()
    for x in ([1.0, -3.0], [], [float("nan"), 2.0], [5.0]):
        obs(torch.tensor(x))
    assert math.isnan(obs.amax)
    obs = _Observer()
    for x in ([1.0, -3.0], [2.0]):
        obs(torch.tensor(x))
    assert obs.amax == 3.0


def test_the_drafters_ranges_never_see_the_anchors_own_taps(tmp_path):
    """A drafted block's anchor is the sequence's last token, whose taps the decoder does not have yet: they are left
    out of the context the drafter is calibrated on. Here they are huge, and change no range (a context that took
    them in survived the suite)."""
    from conftest import write_sources

    cfg = BeamConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     mlp_only_layers=(0,), eos_token_id=2)
    src = write_sources(tmp_path, cfg)
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 64, (n,), generator=g) for n in (5, 9)]
    taps = [torch.randn(1, len(ids), 2 * cfg.hidden_size, generator=g) for ids in sequences]  # as calibrate's

    def ranges(taps):
        return cal.calibrate_drafter(src / "drafter", src / "target", cfg, sequences, taps, 4)

    clean = ranges(taps)
    loud = ranges([torch.cat((t[:, :-1], torch.full_like(t[:, -1:], 1e4)), dim=1) for t in taps])
    assert clean and loud == clean


def test_a_calibration_token_id_at_the_vocab_size_is_refused(tmp_path):
    """Ids run 0..vocab_size-1: the tokenizer's top id equal to vocab_size is outside (it passed, and indexed past the
    embedding later)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from beamtrt.errors import CheckpointError

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a b c d"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(tmp_path)
    chats = [[{"role": "user", "content": "a b c d"}]]  # no chat template: the text itself
    top = int(cal.tokenize(tmp_path, chats, 1, 100)[0].max())
    assert int(cal.tokenize(tmp_path, chats, 1, top + 1)[0].max()) == top
    with pytest.raises(CheckpointError, match=f"gives token id {top}, outside the model's vocab_size {top}$"):
        cal.tokenize(tmp_path, chats, 1, top)
