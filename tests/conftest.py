"""Shared fixtures: tiny random Beam models, and beam-mini built once per session from the SmolLM2 GGUF."""

from __future__ import annotations

import pytest
import torch

from beamtrt.config import BeamConfig
from beamtrt.models.beam import BeamForCausalLM, load_state
from beamtrt.models.random_beam import random_tensors

TINY = BeamConfig(vocab_size=101, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, mlp_only_layers=(0,))


def tiny_model(cfg: BeamConfig = TINY, seed: int = 0, dtype: torch.dtype = torch.float32) -> BeamForCausalLM:
    model = BeamForCausalLM(cfg)
    load_state(model, random_tensors(cfg, seed, torch.float32, std=0.2))
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct loaded from the GGUF (about 50 s, once per session)."""
    from beamtrt.models.beam_mini import load_smollm2

    torch.set_num_threads(2)
    return load_smollm2()


@pytest.fixture(scope="session")
def beam_mini(smollm2, tmp_path_factory):
    """The default beam-mini recipe (bf16, perturbed experts), built into a temp dir."""
    from beamtrt.models.beam_mini import build_beam_mini

    return build_beam_mini(tmp_path_factory.mktemp("mini") / "beam-mini", source=smollm2, progress=False)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and OpenMP spin-waits make them slow on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
