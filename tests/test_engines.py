"""The engine stage and the trt backend without TensorRT: import guards, backend choice, the weights engines read."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from beamtrt.build import drafter_net, engine
from beamtrt.build.pipeline import build
from beamtrt.checkpoint import trtllm
from beamtrt.checkpoint.manifest import read_manifest
from beamtrt.checkpoint.trtllm_files import TrtllmCheckpoint
from beamtrt.config import BeamConfig, BuildConfig, DrafterConfig, EngineSettings
from beamtrt.errors import BeamtrtError, ConfigError
from beamtrt.models.beam import load_beam
from beamtrt.models.dflash2 import random_drafter, save_drafter
from beamtrt.models.random_beam import write_random_beam
from beamtrt.runtime.loader import pick_backend

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = BeamConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
MIXTRAL = dataclasses.replace(QWEN3, use_qk_norm=False)  # exports as MixtralForCausalLM
SHARED = dataclasses.replace(QWEN3, use_qk_norm=False, qkv_bias=True, shared_expert_intermediate_size=64)  # Qwen2-MoE

BLOCKER = """
import sys
for name in ("tensorrt", "tensorrt_llm", "tensorrt_bindings"):
    sys.modules[name] = None  # `import name` now raises ImportError, as on a host without them
"""


def _sources(root: Path, cfg: BeamConfig) -> Path:
    write_random_beam(root / "target", cfg)
    drafter = DrafterConfig.for_target(cfg, num_hidden_layers=1, target_layer_ids=(0, 1), mask_token_id=0)
    save_drafter(random_drafter(drafter, load_beam(root / "target")), root / "drafter")
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return {name: _sources(tmp_path_factory.mktemp(name), cfg)
            for name, cfg in (("qwen3", QWEN3), ("mixtral", MIXTRAL), ("shared", SHARED))}


def _build(src: Path, out: Path, precision: str, tp: int, **kw) -> Path:
    build(BuildConfig(model=src / "target", drafter=src / "drafter", out=out, precision=precision, tp=tp,
                      calib_samples=2, **kw), progress=False)
    return out


def test_package_imports_builds_and_decodes_without_tensorrt(sources, tmp_path):
    """With `tensorrt` / `tensorrt_llm` imports made to fail, every beamtrt module imports, a build completes with
    the engine stage skipped (and saying why), and the build decodes on the torch backend picked by auto."""
    script = BLOCKER + f"""
import importlib, pkgutil
from pathlib import Path
import torch
import beamtrt
for m in pkgutil.walk_packages(beamtrt.__path__, "beamtrt."):
    importlib.import_module(m.name)
from beamtrt.build.pipeline import build
from beamtrt.checkpoint.manifest import read_manifest
from beamtrt.config import BuildConfig
from beamtrt.runtime.dist import Dist
from beamtrt.runtime.loader import load_build, pick_backend
from beamtrt.spec.decoder import Request, SpeculativeDecoder
src, out = Path({str(sources['qwen3'])!r}), Path({str(tmp_path / 'out')!r})
build(BuildConfig(model=src / "target", drafter=src / "drafter", out=out, precision="bf16", tp=1), progress=False)
m = read_manifest(out)
backend, why = pick_backend("auto", m)
loaded = load_build(out, m, Dist.create(), backend=backend)
done = SpeculativeDecoder(loaded.target, loaded.drafter, 4).generate([Request((1, 2, 3), 6)])
print(m["stages"]["engines"]["reason"], "|", backend, "|", why, "|", len(done[0].output_ids))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    reason, backend, why, tokens = proc.stdout.strip().splitlines()[-1].split(" | ")
    assert reason == "TensorRT-LLM is not installed on this host"
    assert (backend, why, tokens) == ("torch", "no engines in the build (TensorRT-LLM is not installed on this host)",
                                      "6")


def test_manifest_says_no_engines(sources, tmp_path):
    m = read_manifest(_build(sources["qwen3"], tmp_path / "out", "bf16", 2))
    assert m["stages"]["engines"] == {"status": "skipped", "key": m["stages"]["engines"]["key"],
                                      "reason": "TensorRT-LLM is not installed on this host"}
    assert m["engines"]["built"] is False and m["engines"]["plugin_library"] is None
    assert m["engines"]["settings"] == {**EngineSettings().to_json(), "max_seq_len": QWEN3.max_position_embeddings}


def test_backend_choice(monkeypatch):
    built = {"stages": {"engines": {"status": "ran"}}, "mapping": {"tp_size": 1}}
    skipped = {"stages": {"engines": {"status": "skipped", "reason": "no CUDA GPU on this host"}},
               "mapping": {"tp_size": 1}}
    assert pick_backend("torch", built) == ("torch", "requested")
    assert pick_backend("auto", None) == ("torch", "a Hugging Face checkpoint runs on torch")
    assert pick_backend("auto", skipped) == ("torch", "no engines in the build (no CUDA GPU on this host)")
    assert pick_backend("auto", built) == ("torch", "TensorRT-LLM is not installed on this host")
    for manifest, needle in ((None, "pass --engine-dir"), (skipped, "the build has no engines (no CUDA GPU"),
                             (built, "TensorRT-LLM is not installed")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
            pick_backend("trt", manifest)
    with pytest.raises(ConfigError, match="unknown backend"):
        pick_backend("tensorrt", None)
    import beamtrt.build.engine

    monkeypatch.setattr(beamtrt.build.engine, "engine_support", lambda: None)  # a TensorRT-LLM host's answer
    tp4 = {**built, "mapping": {"tp_size": 4}}
    assert pick_backend("auto", tp4, 4) == ("trt", "engines and TensorRT-LLM present")
    assert pick_backend("trt", tp4, 4) == ("trt", "requested")
    assert pick_backend("auto", tp4, 1) == ("torch", "the engines need 4 ranks (mpirun -n 4), 1 running")
    with pytest.raises(ConfigError, match=r"^--backend trt: the engines need 4 ranks \(mpirun -n 4\), 1 running$"):
        pick_backend("trt", tp4, 1)


def test_run_with_backend_trt_on_a_build_without_engines_is_one_line(sources, tmp_path):
    out = _build(sources["qwen3"], tmp_path / "out", "bf16", 1)
    proc = subprocess.run([sys.executable, str(ROOT / "runtime/run.py"), "--engine-dir", str(out), "--backend", "trt",
                           "--prompt", "hi"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --backend trt: the build has no engines (TensorRT-LLM is not installed on this host)")


@pytest.mark.parametrize("settings, needle", [
    (dict(max_batch_size=0), "--max-batch-size must be at least 1"),
    (dict(block_size=1), "--block-size must be in [2, 32]"),
    (dict(max_batch_size=64, block_size=8, max_num_tokens=100), "cannot hold one verify step"),
])
def test_engine_settings_are_checked(settings, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        EngineSettings(**settings)


def test_unsupported_targets_are_named():
    assert engine.unsupported(QWEN3) is None and engine.unsupported(MIXTRAL) is None
    assert "soft-caps" in engine.unsupported(dataclasses.replace(QWEN3, final_logit_softcapping=30.0))
    assert "dense and MoE" in engine.unsupported(dataclasses.replace(QWEN3, mlp_only_layers=(0,)))
    assert engine.unsupported(SHARED) is None
    no_shared = dataclasses.replace(SHARED, shared_expert_intermediate_size=0)  # still Qwen2-MoE: it has a qkv bias
    assert "Qwen2-MoE without a shared expert" in engine.unsupported(no_shared)


def test_target_config_has_what_qwen_layers_read():
    """TensorRT-LLM's QWenDecoderLayer reads config.seq_length, which QWenConfig only sets from a Hugging Face
    config: a checkpoint without it fails before any weight loads."""
    config = trtllm.target_config(QWEN3, trtllm.Mapping(), "bf16", "auto", torch.bfloat16)
    assert config["seq_length"] == QWEN3.max_position_embeddings and config["use_logn_attn"] is False


def test_moe_block_scales_are_renamed_before_tensorrt_llm_preprocesses_them():
    fp8 = torch.float8_e4m3fn
    stack = torch.rand(4, 256, 8).to(fp8)  # [E, out, in / 16]
    dense = torch.rand(256, 8).to(fp8)
    weights = {"transformer.layers.0.mlp.fc.weights_scaling_factor": stack,
               "transformer.layers.0.mlp.fc.weights_scaling_factor_2": torch.ones(4),
               "transformer.layers.0.attention.qkv.weights_scaling_factor": dense}
    out = engine.moe_block_scales(dict(weights), lambda t: t.view(torch.uint8).flip(-1).flatten())
    p = "transformer.layers.0.mlp.fc."
    assert set(out) == {p + "weights_block_scaling_factor", p + "weights_block_scaling_factor_interleaved",
                        p + "weights_scaling_factor_2", "transformer.layers.0.attention.qkv.weights_scaling_factor"}
    assert out[p + "weights_block_scaling_factor"] is stack
    interleaved = out[p + "weights_block_scaling_factor_interleaved"]
    assert interleaved.shape == stack.shape and interleaved.dtype == fp8
    assert torch.equal(interleaved.view(torch.uint8), stack.view(torch.uint8).flip(-1))
    assert out["transformer.layers.0.attention.qkv.weights_scaling_factor"] is dense  # 2-D: TensorRT-LLM's own


def _rank_names(path: Path, rank: int) -> set[str]:
    return set(TrtllmCheckpoint(path).open(rank).keys())


@pytest.mark.parametrize("model, precision, tp, extra", [
    ("qwen3", "bf16", 2, {}),
    ("qwen3", "fp8", 1, {"kv_cache": "fp8", "drafter_precision": "fp8"}),
    ("qwen3", "nvfp4", 2, {}),
    ("mixtral", "nvfp4", 1, {}),
    ("shared", "fp8", 2, {}),
])
def test_every_weight_the_engines_read_is_written(sources, tmp_path, model, precision, tp, extra):
    """The target engine's model class and our drafter network read only names our checkpoints hold; the drafter
    network's weights load on the host with the per-rank shapes it is built for."""
    src = sources[model]
    out = _build(src, tmp_path / "out", precision, tp, **extra)
    cfg = BeamConfig.from_file(src / "target" / "config.json")
    wanted = engine.target_weight_names(cfg, precision, extra.get("kv_cache", "auto"))
    net = drafter_net.NetConfig.from_checkpoints(out / "drafter", out / "target", EngineSettings())
    assert (net.tp_size, net.num_taps, net.local_kv_heads) == (tp, 2, 2 // tp)
    for rank in range(tp):
        target_names = _rank_names(out / "target", rank)
        assert not wanted - target_names, sorted(wanted - target_names)[:3]
        names = {"drafter": _rank_names(out / "drafter", rank), "target": target_names}
        missing = [n for n, source in drafter_net.weight_table(net) if source != "derived" and n not in names[source]]
        assert not missing, missing[:3]
        weights = drafter_net.rank_weights(out / "drafter", out / "target", rank, net)
        D = net.head_dim
        assert weights["transformer.layers.0.attention.qkv.weight"].shape == (
            (net.local_heads + 2 * net.local_kv_heads) * D, net.hidden_size)
        assert weights["candidate_selector.successor_codebook"].shape == (net.vocab_size, net.selector_rank)
        assert weights["lm_head.weight"].shape == (net.vocab_size // tp, net.hidden_size)
        assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_drafter_net_config_round_trips(sources, tmp_path):
    """The drafter engine's config.json is NetConfig as JSON; the trt backend reads it back."""
    out = _build(sources["qwen3"], tmp_path / "out", "bf16", 1)
    net = drafter_net.NetConfig.from_checkpoints(out / "drafter", out / "target", EngineSettings(block_size=4))
    assert drafter_net.NetConfig(**json.loads(json.dumps(dataclasses.asdict(net)))) == net
    assert net.block_size == 4 and net.window == 4096 and net.dtype == "bfloat16"


def test_backend_comparison_report(tmp_path):
    """gpu_host_check.sh's table: identity judged per request against the first run; bad reports are one line."""
    from beamtrt.bench.backends import compare, main, table

    def report(outputs, tau, speed):
        return {"requests": [{"output_ids": ids} for ids in outputs],
                "summary": {"acceptance_length": tau, "tokens_per_s": speed}}

    same, other = report([[1, 2], [3, 4]], 2.5, 100.0), report([[1, 2], [3, 5]], 2.25, 400.0)
    result = compare({"torch": same, "trt": other})
    assert result["torch"]["identical"] and not result["trt"]["identical"]
    assert result["trt"]["first_mismatch"] == 1 and result["trt"]["tokens_per_s"] == 400.0
    assert "| trt | no (request 1 differs) | 2.25 | 400.0 |" in table(result)
    assert "| once | yes | - | 9.0 |" in table(compare({"once": report([[1, 2], [3, 4]], None, 9.0)}))  # no step
    (tmp_path / "a.json").write_text(json.dumps(same))
    (tmp_path / "bad.json").write_text("{}")
    assert main([f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'a.json'}"]) == 0
    assert main([f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'bad.json'}"]) == 2
    assert main([f"a={tmp_path / 'missing.json'}"]) == 2
    assert main(["no-equals-sign"]) == 2
    with pytest.raises(SystemExit, match="^2$"):  # a run given twice, refused as every repeated list value is
        main([f"a={tmp_path / 'a.json'}", f"a={tmp_path / 'a.json'}"])
    assert main([f"a={tmp_path / 'a.json'}", f"a={tmp_path / 'b.json'}"]) == 2  # the second replaced the first
    assert main([f"a|b={tmp_path / 'a.json'}"]) == 2
    for damaged in ({**same, "requests": [{"output_ids": [1]}, {}]}, {**same, "requests": []},
                    {**same, "summary": {"acceptance_length": 2.0, "tokens_per_s": None}},
                    {**same, "summary": {"acceptance_length": "2", "tokens_per_s": 1.0}}, []):
        (tmp_path / "bad.json").write_text(json.dumps(damaged))  # each was a traceback (KeyError, TypeError)
        assert main([f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'bad.json'}"]) == 2
    assert main([f"a={tmp_path / 'a.json'}", "--json", str(tmp_path)]) == 2  # a folder: before the table
    (tmp_path / "b.json").write_text(json.dumps(other))
    assert main([f"a={tmp_path / 'a.json'}", f"b={tmp_path / 'b.json'}", "--json", str(tmp_path / "b.json")]) == 2
    assert json.loads((tmp_path / "b.json").read_text()) == other  # a report it compares: it was replaced


def test_backend_comparison_refuses_runs_of_other_prompts_or_settings():
    """Runs of other prompts or sampling settings were compared as if they were one experiment (their outputs
    'differ'); what a report does not record is not held against it."""
    from beamtrt.bench.backends import compare

    def report(prompts, **settings):
        return {"requests": [{"output_ids": [1], "messages": [{"role": "user", "content": p}]} for p in prompts],
                "summary": {"acceptance_length": 2.0, "tokens_per_s": 1.0},
                "settings": {"seed": 0, "temperature": 0.0, "max_new_tokens": 8, "stop": [], **settings}}

    ref = report(["a", "b"])
    assert compare({"torch": ref, "trt": report(["a", "b"], backend="trt", model="elsewhere")})["trt"]["identical"]
    with pytest.raises(BeamtrtError, match=r"^run 'trt' asked other prompts than 'torch' \(request 1 first\)"):
        compare({"torch": ref, "trt": report(["a", "c"])})
    for key, value, flag in (("temperature", 0.7, "--temperature 0.7"), ("max_new_tokens", 9, "--max-new-tokens 9"),
                             ("stop", ["x"], "--stop ['x']"), ("seed", 1, "--seed 1")):
        with pytest.raises(BeamtrtError, match=f"^run 'trt' ran with {re.escape(flag)}, 'torch' with"):
            compare({"torch": ref, "trt": report(["a", "b"], **{key: value})})
    older = {k: v for k, v in report(["a", "c"]).items() if k != "settings"}
    for r in older["requests"]:
        del r["messages"]
    assert compare({"torch": ref, "old": older})["old"]["identical"]


def test_target_step_packing():
    """A verify step as the target engine receives it: padding removed, positions after each cached prefix, and the
    gathered rows = every real token (or each request's last), 1-based in the packed input."""
    from beamtrt.runtime.trt_backend import pack

    ids = torch.tensor([[5, 6, 7], [8, 0, 0], [9, 10, 0]])
    num, past = torch.tensor([3, 1, 2]), torch.tensor([4, 0, 10])
    feeds = pack(ids, num, past, last_only=False)
    assert feeds["input_ids"].tolist() == [5, 6, 7, 8, 9, 10]
    assert feeds["position_ids"].tolist() == [4, 5, 6, 0, 10, 11]
    assert feeds["last_token_ids"].tolist() == [1, 2, 3, 4, 5, 6]
    assert feeds["sequence_length"].tolist() == feeds["host_past_key_value_lengths"].tolist() == [7, 1, 12]
    assert feeds["context_lengths"].tolist() == [3, 1, 2]
    assert pack(ids, num, past, last_only=True)["last_token_ids"].tolist() == [3, 4, 6]
    packed = feeds["input_ids"]
    assert [packed[i - 1].item() for i in pack(ids, num, past, True)["last_token_ids"]] == [7, 8, 10]


def test_drafter_context_chunks():
    """Pending context rows become engine calls of at most `chunk` rows per slot; rows older than the window are
    skipped (counted, so positions stay right); an idle step still makes the one drafting call."""
    from beamtrt.runtime.trt_backend import context_chunks

    rows = lambda a, b: torch.arange(a, b).float().view(-1, 1)  # noqa: E731  row value = its position
    skipped, calls = context_chunks([[rows(0, 5), rows(5, 12)], [], [rows(0, 3)]], window=10, chunk=4)
    assert skipped.tolist() == [2, 0, 0]
    assert [c.tolist() for _, c in calls] == [[4, 0, 3], [4, 0, 0], [2, 0, 0]]
    assert torch.cat([part[0] for part, _ in calls]).flatten().tolist() == list(range(2, 12))
    assert calls[0][0][1] is None and calls[1][0][2] is None
    skipped, calls = context_chunks([[], []], window=10, chunk=4)
    assert skipped.tolist() == [0, 0] and [c.tolist() for _, c in calls] == [[0, 0]]


def test_engines_refuse_more_requests_than_they_were_built_for():
    """An engine's single optimization profile stops at its --max-batch-size: both backends refuse more cache slots
    with one line naming the remedy, before allocating anything."""
    from types import SimpleNamespace

    from beamtrt.runtime.trt_backend import EngineError, TrtDrafter, TrtTarget

    target, drafter = object.__new__(TrtTarget), object.__new__(TrtDrafter)  # no engine: the checks come first
    target.max_batch_size, target.max_seq_len = 4, 100
    drafter.cfg = SimpleNamespace(max_batch_size=4)
    with pytest.raises(EngineError, match=r"^5 requests at once exceed the target engine's --max-batch-size 4: "
                                          r"decode at most 4 at once \(run.py --concurrency"):
        target.allocate(5, 10)
    with pytest.raises(EngineError, match="exceed the drafter engine's --max-batch-size 4"):
        drafter.allocate(5)


@pytest.mark.parametrize("window, vocab", [(4096, None), (5, None), (4096, list(range(1, 128, 5)))])
def test_drafter_network_drafts_like_the_reference(sources, tmp_path, window, vocab):
    """drafter_net's own code, run with PyTorch stand-ins for TensorRT-LLM's functional API and the plugins' host
    build (tests/drafter_net_torch.py), drafts exactly what the reference drafter drafts: two steps per request,
    the second appending more context to the rings (window 5: the ring wraps); with a draft vocabulary (the
    build carries draft_vocab.json over), from it alone."""
    from beamtrt.checkpoint.trtllm_files import load_drafter_checkpoint, load_target
    from beamtrt.models.beam import Rotary
    from beamtrt.spec.selector import walk_greedy
    from drafter_net_torch import OUTPUTS, T, torch_api

    src = sources["qwen3"]
    if vocab is not None:
        src = tmp_path / "src"
        shutil.copytree(sources["qwen3"], src)
        (src / "drafter" / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab}))
    out = _build(src, tmp_path / "out", "bf16", 1)
    assert (out / "drafter" / "draft_vocab.json").exists() == (vocab is not None)
    target = load_target(out / "target", dtype=torch.float32)
    reference = load_drafter_checkpoint(out / "drafter", target, dtype=torch.float32)
    assert (reference.draft_vocab is not None) == (vocab is not None)
    reference.cfg = dataclasses.replace(reference.cfg, sliding_window=window)
    net_cfg = dataclasses.replace(drafter_net.NetConfig.from_checkpoints(out / "drafter", out / "target",
                                                                         EngineSettings(block_size=4)), window=window)
    weights = drafter_net.rank_weights(out / "drafter", out / "target", 0, net_cfg, dtype=torch.float32)
    net = drafter_net.DFlash2Network(net_cfg, 0, weights, api=torch_api())
    rotary = Rotary(reference.cfg)
    N, B, F_ = 3, net_cfg.block_size, net_cfg.num_taps * net_cfg.target_hidden_size
    gen = torch.Generator().manual_seed(0)
    cache = reference.new_cache(N)
    rings = [[torch.zeros(N, net_cfg.local_kv_heads, window, net_cfg.head_dim) for _ in "kv"]
             for _ in range(net_cfg.num_layers)]
    start = torch.zeros(N, dtype=torch.long)
    for counts in (torch.tensor([6, 2, 4]), torch.tensor([3, 1, 2])):
        C = int(counts.max())
        taps = torch.randn(N, C, F_, generator=gen)
        anchors = torch.randint(1, net_cfg.vocab_size, (N,), generator=gen)
        reference.append_context(cache, taps, counts)
        ref = reference.draft(cache, anchors, B)
        ref_drafts, _ = walk_greedy(ref.cand_ids, ref.scores)
        ctx_rope = rotary(start[:, None] + torch.arange(C)[None, :], torch.float32)
        block_rope = rotary((start + counts)[:, None] + torch.arange(B)[None, :], torch.float32)
        OUTPUTS.clear()
        net(T(anchors.int()), T(taps), T(start.int()), T(counts.int()), [T(r) for r in ctx_rope],
            [T(r) for r in block_rope], T(torch.zeros(N)), T(torch.ones(N)), T(torch.zeros(N, B - 1)),
            [[T(k), T(v)] for k, v in rings])
        assert torch.equal(OUTPUTS["cand_ids"].long(), ref.cand_ids)
        assert torch.equal(OUTPUTS["draft_ids"].long(), ref_drafts)
        assert vocab is None or set(ref.cand_ids.flatten().tolist()) <= set(vocab)
        for i in range(net_cfg.num_layers):  # the rings hold the reference cache's context K/V
            torch.testing.assert_close(rings[i][0], cache.k[i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(rings[i][1], cache.v[i], atol=1e-5, rtol=1e-5)
        start += counts


def test_the_plugin_toolchain_is_checked_before_the_first_stage(sources, tmp_path, monkeypatch):
    """On a TensorRT-LLM host the plugin library is built last, after calibration and conversion (hours on Beam): a
    missing TensorRT include folder (pip's wheels ship none) failed there, and the build kept none of its stages."""
    from beamtrt.build import engine, pipeline
    from beamtrt.quant import calibrate

    monkeypatch.setattr(engine, "engine_support", lambda: None)  # a TensorRT-LLM host's answers
    monkeypatch.setattr(engine, "precision_unsupported", lambda *a: None)
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    monkeypatch.setattr(pipeline, "_run", lambda *a, **k: pytest.fail("a stage ran"))
    with pytest.raises(engine.EngineError, match=rf"^no TensorRT headers in {tmp_path}/include \(pass --tensorrt-root"):
        _build(sources["qwen3"], tmp_path / "out", "fp8", 1,
               engine=EngineSettings(tensorrt_root=str(tmp_path)))
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_drafter_beyond_the_plugin_kernels_gets_no_engine(sources, tmp_path, monkeypatch):
    """The drafter engine's plugins hold at most 64 selector candidates and head_dim 256: a drafter beyond them was
    built into an engine that refused it at its first draft. On a TensorRT-LLM host its engines are now skipped,
    saying why, and it runs on the torch backend (whose reference path takes any size)."""
    from beamtrt.build import engine, pipeline

    monkeypatch.setattr(engine, "engine_support", lambda: None)  # a TensorRT-LLM host's answers
    monkeypatch.setattr(engine, "precision_unsupported", lambda *a: None)
    src = tmp_path / "src"
    shutil.copytree(sources["qwen3"], src)
    bc = BuildConfig(model=src / "target", drafter=src / "drafter", out=tmp_path / "out", precision="bf16", tp=1)
    assert pipeline.Plan(bc).engines_why is None
    config = json.loads((src / "drafter" / "config.json").read_text())
    (src / "drafter" / "config.json").write_text(json.dumps({**config, "selector_top_k": 100}))  # the weights fit
    assert pipeline.Plan(bc).engines_why == ("the drafter does not fit the plugin kernels (its selector_top_k 100 is "
                                             "above the kernels' 64 candidates; it runs on the torch backend)")
    cfg = DrafterConfig.from_dict(config)
    assert engine.drafter_unsupported(dataclasses.replace(cfg, head_dim=512)) == (
        "the drafter does not fit the plugin kernels (its head_dim 512 is above the kernels' 256; it runs on the "
        "torch backend)")
    assert "DFlash v1" in engine.drafter_unsupported(dataclasses.replace(cfg, version=1))


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cmake") is None, reason="needs nvcc and cmake")
def test_a_failed_plugin_build_names_its_first_error(tmp_path, monkeypatch):
    """build_engines.py builds the plugin library with CMake; a compile failure is reported by its first error line,
    not by make's closing 'Error 2'. Here a TensorRT tree with NvInfer.h and nothing else."""
    root = tmp_path / "tensorrt"
    (root / "include").mkdir(parents=True)
    (root / "include" / "NvInfer.h").write_text("#pragma once\n")
    monkeypatch.setattr(engine, "cuda_archs", lambda: "90")  # no GPU here to ask
    with pytest.raises(engine.EngineError,
                       match=r"^building the plugin library failed \(cmake --build\): \S+plugin_base\.h:\d+:\d+: "
                             r"fatal error: NvInferRuntime\.h: No such file"):
        engine.build_plugin_library(tmp_path / "out", str(root))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("style", ["TRT_{}_ENTERPRISE", "NV_TENSORRT_{}"])  # 10.14 and later / earlier headers
def test_plugin_headers_of_another_tensorrt_major_are_refused(tmp_path, monkeypatch, style):
    """A plugin library built against another major version's headers crashes TensorRT when it logs (ILogger's layout
    changed between 10 and 11): refused before CMake runs, naming both versions."""
    include = tmp_path / "tensorrt" / "include"
    include.mkdir(parents=True)
    (include / "NvInfer.h").write_text("#pragma once\n")
    (include / "NvInferVersion.h").write_text("".join(f"#define {style.format(part)} {value}\n"
                                                      for part, value in zip(("MAJOR", "MINOR", "PATCH"), (11, 1, 0))))
    assert engine.header_version(include.parent) == (11, 1, 0)
    monkeypatch.setattr(engine, "tensorrt_version", lambda: (10, 14, 1))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("CMake ran"))
    with pytest.raises(engine.EngineError, match=r"^the TensorRT headers in \S+ are 11\.1\.0 but this process runs "
                                                 r"TensorRT 10\.14\.1: "):
        engine.build_plugin_library(tmp_path / "out", str(include.parent))
    monkeypatch.setattr(engine, "tensorrt_version", lambda: None)  # no tensorrt module: nothing to compare
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "CMake Error at CMakeLists.txt:1 (project): stop here\n-- Configuring incomplete"))
    with pytest.raises(engine.EngineError,
                       match=r"\(cmake -S\): CMake Error at CMakeLists\.txt:1 \(project\): stop here$"):
        engine.build_plugin_library(tmp_path / "out", str(include.parent))
