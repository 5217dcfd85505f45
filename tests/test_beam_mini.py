"""beam-mini reproduces SmolLM2 when unperturbed, stays coherent when perturbed, and shards at TP 1, 2, 4."""

import json
from dataclasses import asdict, fields

import pytest
import torch

from beamtrt.checkpoint.hf import CheckpointReader
from beamtrt.config import BeamConfig
from beamtrt.errors import BeamtrtError, CheckpointError
from beamtrt.models.beam import load_beam
from beamtrt.models.beam_mini import MARKER, MiniRecipe, SmolLM2Config, build_beam_mini
from beamtrt.runtime.generate import generate

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "List three colors of the rainbow.",
    "Explain what a cat is in one sentence.",
    "What is 12 plus 7?",
]


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def exact_mini(smollm2, tmp_path_factory):
    recipe = MiniRecipe(perturbation=0.0, dtype="float32")
    path = build_beam_mini(tmp_path_factory.mktemp("exact") / "bm", recipe, source=smollm2, progress=False)
    return load_beam(path)


def test_unperturbed_fp32_reproduces_smollm2_logits(smollm2, exact_mini):
    hf, tok = smollm2
    for prompt in PROMPTS:
        ids = torch.tensor([chat_ids(tok, prompt)])
        with torch.no_grad():
            ref = hf(ids).logits
        got = exact_mini(ids, exact_mini.new_cache(1, ids.shape[1])).logits
        assert float((got - ref).norm() / ref.norm()) < 1e-4


def test_unperturbed_fp32_greedy_equals_smollm2_for_32_tokens(smollm2, exact_mini):
    hf, tok = smollm2
    prompts = [chat_ids(tok, p) for p in PROMPTS]
    ours = generate(exact_mini, prompts, 32)  # batched, ragged prompts
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert got == want


def test_default_recipe_layout_and_padding(beam_mini):
    cfg = BeamConfig.from_file(beam_mini)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (12, 4, 64)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.use_qk_norm) == (4, 2, True, False)
    for tp in (1, 2, 4):
        assert cfg.num_attention_heads % tp == 0 and cfg.num_key_value_heads % tp == 0
    reader = CheckpointReader(beam_mini)
    assert {reader.dtype(n) for n in reader.names()} == {torch.bfloat16}
    q = reader.get("model.layers.3.self_attn.q_proj.weight")
    o = reader.get("model.layers.3.self_attn.o_proj.weight")
    assert q.shape == (768, 576) and bool((q[576:] == 0).all()) and bool((o[:, 576:] == 0).all())
    assert bool((q[:576] != 0).any())
    e0 = reader.get("model.layers.3.mlp.experts.0.up_proj.weight")
    e1 = reader.get("model.layers.3.mlp.experts.1.up_proj.weight")
    assert not torch.equal(e0, e1)  # perturbed: routing matters
    rel = float((e0.float() - e1.float()).norm() / e0.float().norm())
    assert 0.005 < rel < 0.1
    assert (beam_mini / "tokenizer.json").is_file() or (beam_mini / "tokenizer_config.json").is_file()
    assert json.loads((beam_mini / MARKER).read_text())["perturbation"] == MiniRecipe().perturbation


def test_default_recipe_greedy_is_coherent(beam_mini):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(beam_mini)
    model = load_beam(beam_mini, dtype=torch.float32)
    eos = model.cfg.eos_token_id
    outs = generate(model, [chat_ids(tok, p) for p in PROMPTS[:2]], 40, eos_ids=[eos])
    capital, code = (tok.decode(o, skip_special_tokens=True) for o in outs)
    assert "Paris" in capital
    assert "def " in code and "return" in code


def test_build_is_idempotent_and_atomic(beam_mini, smollm2, monkeypatch):
    src = smollm2[0].config  # beam-mini's size is measured on these before the GGUF is read
    assert {f.name: getattr(src, f.name) for f in fields(SmolLM2Config)} == pytest.approx(asdict(SmolLM2Config()))
    before = {p.name: p.stat().st_mtime_ns for p in beam_mini.iterdir()}
    build_beam_mini(beam_mini, source=smollm2, progress=False)  # same recipe: nothing rewritten
    assert {p.name: p.stat().st_mtime_ns for p in beam_mini.iterdir()} == before
    with pytest.raises(CheckpointError, match=r"holds beam-mini of another recipe \(dtype bfloat16 -> float32\): "
                                              r"pass --force to replace it"):
        build_beam_mini(beam_mini, MiniRecipe(dtype="float32"), source=smollm2, progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in beam_mini.iterdir()} == before

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("beamtrt.models.beam_mini.write_json", boom)
    out = beam_mini.parent / "broken"
    with pytest.raises(RuntimeError, match="disk full"):
        build_beam_mini(out, source=smollm2, progress=False)
    assert not out.exists()
    assert [p.name for p in beam_mini.parent.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.experts.0.gate_proj.weight is not finite in "
                                              r"bfloat16 with --perturbation 1e\+300: give a smaller one"):
        build_beam_mini(out, MiniRecipe(perturbation=1e300), source=smollm2, progress=False)  # it wrote inf, NaN
    assert not out.exists()
    monkeypatch.setattr("beamtrt.cli_util.free_bytes", lambda path: 10**8)  # a disk with 100 MB free
    with pytest.raises(BeamtrtError, match=r"beam-mini with 4 experts a layer is a 0\.\d+ GB checkpoint; .* has "
                                            r"0\.1 GB free"):
        build_beam_mini(out, source=smollm2, progress=False)  # refused before the first tensor is written
    assert not out.exists()


def test_the_random_default_drafter_is_beam_minis_whatever_target_asked_first(beam_mini, tmp_path, monkeypatch):
    """Without a trained drafter, another target asking first gets one line offering --drafter, and the random drafter
    made on the way is beam-mini's (it used to be made from that target's layout, and beam-mini then got it)."""
    from beamtrt.config import DrafterConfig
    from beamtrt.errors import ConfigError
    from beamtrt.models import beam_mini as bm
    from beamtrt.models.random_beam import write_random_beam
    from beamtrt.runtime.loader import hf_sources

    monkeypatch.setattr(bm, "DEFAULT_DIR", beam_mini)
    monkeypatch.setattr(bm, "TRAINED_DRAFTER", tmp_path / "no-trained-drafter")
    monkeypatch.setattr(bm, "RANDOM_DRAFTER", tmp_path / "random")
    other = write_random_beam(tmp_path / "other", BeamConfig(
        vocab_size=1024, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2))
    with pytest.raises(ConfigError, match="default drafter .* is beam-mini's and does not fit this target .* "
                                          "pass --drafter DIR .*, or --no-spec$"):
        hf_sources(other, None, True, "--no-spec")
    assert DrafterConfig.from_file(tmp_path / "random" / "config.json").vocab_size == 49152
    assert hf_sources(beam_mini, None, True)[1] == tmp_path / "random"


def test_creating_says_so_before_the_gguf_is_read(tmp_path, monkeypatch, capsys):
    """Reading the GGUF is the first quarter minute: a line says what is happening before it, not after."""
    from beamtrt.models import beam_mini as bm

    def read():
        assert capsys.readouterr().out == (f"beam-mini: creating {tmp_path / 'm'} from {bm.GGUF_FILE} (about half a "
                                           "minute; later runs reuse it)\n")
        raise KeyboardInterrupt  # stop here
    monkeypatch.setattr(bm, "load_smollm2", read)
    with pytest.raises(KeyboardInterrupt):
        bm.build_beam_mini(tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_two_first_uses_at_once_make_beam_mini_once(tmp_path):
    """Two commands started together on a fresh checkout: the second waits for the first's beam-mini and uses it (it
    built its own beside it, then swapped the folder under the first, or failed on the first's staging folder)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    log, release = tmp_path / "builds.log", tmp_path / "release"
    code = ("import sys, time\n"
            f"sys.path[:0] = [{str(src)!r}]\n"
            "from pathlib import Path\n"
            "from beamtrt.models import beam_mini as bm\n"
            "def build(out):  # the half minute of a real build: until the test releases it\n"
            f"    open({str(log)!r}, 'a').write('build\\n')\n"
            f"    while not Path({str(release)!r}).exists():\n"
            "        time.sleep(0.05)\n"
            "    out.mkdir()\n"
            "    (out / bm.MARKER).write_text('{}')\n"
            "    return out\n"
            "bm.build_beam_mini, bm.check_built = build, lambda *a: None\n"
            "print(bm.ensure_beam_mini(Path(sys.argv[1])))\n")
    out = tmp_path / "checkpoints" / "beam-mini"
    out.parent.mkdir()

    def start(name):
        with open(tmp_path / f"{name}.out", "w") as so, open(tmp_path / f"{name}.err", "w") as se:
            return subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=so, stderr=se)

    def until(done):
        deadline = time.monotonic() + 60
        while not done() and time.monotonic() < deadline:
            time.sleep(0.05)

    first = start("first")
    until(log.exists)  # the first is building
    second = start("second")  # waits, or (before the lock) builds too
    until(lambda: "waiting" in (tmp_path / "second.err").read_text() or log.read_text().count("build") > 1)
    release.touch()
    assert (first.wait(timeout=60), second.wait(timeout=60)) == (0, 0), (tmp_path / "second.err").read_text()
    assert log.read_text() == "build\n"
    assert (tmp_path / "second.out").read_text() == f"{out}\n"
    assert "note: waiting for another process" in (tmp_path / "second.err").read_text()
