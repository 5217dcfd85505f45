"""Shared fixtures: tiny random Beam models, and beam-mini built once per session (per test worker) from SmolLM2."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from beamtrt.config import BeamConfig
from beamtrt.models.beam import BeamForCausalLM, load_state
from beamtrt.models.random_beam import random_tensors

TINY = BeamConfig(vocab_size=101, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                  num_experts_per_tok=2, mlp_only_layers=(0,))


class Terminal(io.StringIO):
    """stderr as a terminal (progress bars are drawn on terminals only), kept where a test can read it."""

    def isatty(self) -> bool:
        return True


def tiny_model(cfg: BeamConfig = TINY, seed: int = 0, dtype: torch.dtype = torch.float32) -> BeamForCausalLM:
    model = BeamForCausalLM(cfg)
    load_state(model, random_tensors(cfg, seed, torch.float32, std=0.2))
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct from the GGUF (about 50 s, once per session: per test worker)."""
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


@pytest.fixture(params=["torch", "native"])
def step_path(request, monkeypatch):
    """Run the test once on each CPU step path: eager PyTorch, and the fused host kernel for every forward (not only
    the short ones it takes by default), so that each path is compared with itself."""
    from beamtrt import native

    if request.param == "torch":
        monkeypatch.setenv("BEAMTRT_NATIVE", "0")
    else:
        if not native.available():
            pytest.skip("the host kernels cannot be built here")
        monkeypatch.setenv("BEAMTRT_NATIVE", "1")
        monkeypatch.setattr(native, "MAX_ROWS", 1 << 30)
    return request.param


# The files that take minutes, longest first. `make test` hands whole files to two pytest-xdist workers in the order
# collected (its reordering by test count is off), so these start first and the last minutes are not one of them
# running alone while the other worker idles.
SLOW_FILES = ("test_plugins.py", "test_cli.py", "test_mpi.py", "test_build.py", "test_spec_sampling_exact.py",
              "test_beam_mini.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOW_FILES)))  # stable: a file's tests stay in order


PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "List three prime numbers.",
           "How do bees make honey?", "Explain TCP in one sentence.", "Name a famous painter.",
           "What is 12 times 7?", "Describe the color blue."]


def write_sources(root: Path, cfg: BeamConfig, tokenizer: Path | None = None) -> Path:
    """A random Beam target of `cfg` (root/target, with the tokenizer files of the checkpoint `tokenizer`, if given),
    a random one-layer drafter tapping layers 0 and 2 with a draft vocabulary (the even token ids) whose mask token is
    the last id (as DFlash drafters' are: under tensor parallelism it lies in the last rank's rows), and
    prompts.jsonl (PROMPTS): what build/build_engines.py takes."""
    import json
    import shutil

    from beamtrt.config import DrafterConfig
    from beamtrt.models.beam import load_beam
    from beamtrt.models.dflash2 import random_drafter, save_drafter
    from beamtrt.models.random_beam import write_random_beam

    write_random_beam(root / "target", cfg, seed=1, dtype=torch.float32)
    for f in tokenizer.iterdir() if tokenizer else ():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(f, root / "target" / f.name)
    target = load_beam(root / "target")
    drafter = DrafterConfig.for_target(cfg, num_hidden_layers=1, target_layer_ids=(0, 2))  # mask id: the last token
    drafter = random_drafter(drafter, target, std=0.2)
    drafter.set_draft_vocab(range(0, cfg.vocab_size, 2))  # builds carry it over; every runtime drafts from even ids
    save_drafter(drafter, root / "drafter")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


@pytest.fixture(scope="session")
def mini_vocab_sources(tmp_path_factory, beam_mini):
    """write_sources: a small random Beam target with beam-mini's vocabulary and tokenizer (8 query / 2 KV heads,
    8 experts) and its drafter."""
    vocab = BeamConfig.from_file(beam_mini / "config.json").vocab_size
    cfg = BeamConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
                     num_experts=8, num_experts_per_tok=2, mlp_only_layers=(0,), use_qk_norm=True, eos_token_id=2)
    return write_sources(tmp_path_factory.mktemp("mini-vocab"), cfg, tokenizer=beam_mini)


@contextlib.contextmanager
def written_by_another_process(folder: Path):
    """Another process holds `folder` through beamtrt.checkpoint.hf.writing while the block runs."""
    code = ("import sys, time\nfrom beamtrt.checkpoint.hf import writing\n"
            "with writing(sys.argv[1]):\n    print('holding', flush=True)\n    time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline() == "holding\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
