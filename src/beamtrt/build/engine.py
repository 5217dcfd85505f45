"""The engine stage: TensorRT-LLM 1.2 engines for the target and the drafter, and the plugin library (guarded).

Everything that imports `tensorrt` / `tensorrt_llm` is inside functions, so the package imports without them;
`engine_support()` says in one line why this host cannot build engines. Every TensorRT-LLM call made here is
listed, with its 1.2.x source file, in docs/trtllm-api.md.

Layout written into a build output (DESIGN §5): `target/engine/{config.json, rank<r>.engine}`,
`drafter/engine/{config.json, rank<r>.engine}`, `plugins/libbeamtrt_plugins.so`. The engines sit in their own
folders because TensorRT-LLM's `Engine.save` writes a config.json of its own beside them.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

from beamtrt.checkpoint import trtllm
from beamtrt.cli_util import child_error
from beamtrt.config import BeamConfig, EngineSettings
from beamtrt.errors import DeviceError

TRTLLM_PINNED = "1.2"      # the last release line with the TensorRT engine backend (`reference/trtllm.md` §0)
TAP_OUTPUT = "beamtrt_tap_{}"  # extra target engine output: the residual stream after target layer {}
ENGINE_DIR = "engine"
PLUGIN_DIR = "plugins"
PLUGINS_SOURCE = Path(__file__).resolve().parents[3] / "plugins"
GEMM_PLUGIN = {"bf16": "auto", "fp8": "auto", "nvfp4": "nvfp4"}  # PluginConfig.gemm_plugin per precision


class EngineError(DeviceError):
    """The engine stage cannot run or failed: wrong TensorRT-LLM, no GPU, no TensorRT headers, a build error."""


def trtllm_version() -> str | None:
    """The installed TensorRT-LLM version, or None when it is not importable here."""
    try:
        import tensorrt_llm
    except Exception:  # not installed, or its import fails without the TensorRT libraries / CUDA
        return None
    return str(getattr(tensorrt_llm, "__version__", "unknown"))


def engine_support() -> str | None:
    """None where engines can be built and run here, else why not (one line)."""
    version = trtllm_version()
    if version is None:
        return "TensorRT-LLM is not installed on this host"
    if not version.startswith(TRTLLM_PINNED + "."):
        return f"TensorRT-LLM {version} is installed; beamtrt's engines need TensorRT-LLM {TRTLLM_PINNED}.x"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU on this host"
    return None


def unsupported(cfg: BeamConfig) -> str | None:
    """Why TensorRT-LLM's own model classes cannot run this target exactly, or None."""
    if cfg.logit_scale != 1.0 or cfg.final_logit_softcapping is not None:
        return "the target scales or soft-caps its logits, which TensorRT-LLM's Qwen/Mixtral classes do not"
    if cfg.num_experts and not all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        return "the target mixes dense and MoE layers, which this engine stage does not build yet"
    if cfg.attention_bias:
        return "the target has an o_proj bias, which TensorRT-LLM's Qwen attention does not"
    if trtllm.target_architecture(cfg)[1] == "qwen2_moe" and not cfg.shared_expert_intermediate_size:
        return "the target exports as Qwen2-MoE without a shared expert, which TensorRT-LLM's Qwen2-MoE layer " \
               "always has"
    return None


def drafter_unsupported(cfg) -> str | None:
    """Why the drafter engine cannot run the drafter of DrafterConfig `cfg` (it runs on the torch backend), or None:
    a DFlash v1 drafter, or one beyond the plugin kernels' fixed arrays (the plugin refused it at its first draft)."""
    from beamtrt.native.kernels import beyond_kernels

    if cfg.version != 2:
        return "a DFlash v1 drafter has no drafter engine (it runs on the torch backend)"
    why = beyond_kernels(cfg)
    return f"the drafter does not fit the plugin kernels ({why}; it runs on the torch backend)" if why else None


def moe_block_scales(weights: dict, interleave) -> dict:
    """A `from_checkpoint` hook for NVFP4 targets: each expert stack's block scales [E, out, in / 16] become the
    `weights_block_scaling_factor` (+ `_interleaved`, by `interleave`, shape kept) that TensorRT-LLM's MoE layer
    loads. Some TensorRT-LLM revisions' NVFP4 preprocessing unpacks every `weights_scaling_factor` as 2-D and fails
    on these; renamed first, it leaves them alone (and does the same as revisions that handle them)."""
    for name in [n for n, t in weights.items() if n.endswith(".weights_scaling_factor") and t.ndim == 3]:
        scale = weights.pop(name)
        block = name.replace("weights_scaling_factor", "weights_block_scaling_factor")
        weights[block] = scale
        weights[block + "_interleaved"] = interleave(scale).reshape(scale.shape).view(scale.dtype)
    return weights


def precision_unsupported(precision: str, kv_cache: str = "auto") -> str | None:
    """Why this host's GPUs cannot run `precision` engines, or None (NVFP4 GEMMs need Blackwell, FP8 Ada+). An FP8 KV
    cache under bf16 weights is refused: TensorRT-LLM then turns off the paged context FMHA the trt backend needs."""
    import torch

    if kv_cache == "fp8" and precision == "bf16":
        return "TensorRT-LLM builds an FP8 KV cache under bf16 weights without paged context FMHA, which the trt " \
               "backend needs (use --kv-cache auto, or fp8 / nvfp4 weights)"

    major, minor = torch.cuda.get_device_capability()
    if precision == "nvfp4" and major < 10:
        return f"NVFP4 engines need a Blackwell GPU (sm_100 or newer); this one is sm_{major}{minor}"
    if precision == "fp8" and (major, minor) < (8, 9):
        return f"FP8 engines need sm_89 or newer; this GPU is sm_{major}{minor}"
    return None


def plugin_sources() -> list[Path]:
    """The plugin library's sources (they key the engine stage: a kernel change rebuilds the engines)."""
    return sorted(p for p in PLUGINS_SOURCE.rglob("*") if p.is_file() and "_build" not in p.parts
                  and p.suffix in (".h", ".cuh", ".cu", ".cpp", ".txt"))


# What TensorRT-LLM 1.2's model classes read from our target checkpoint (docs/trtllm-api.md: qwen/model.py
# QWenForCausalLM for Qwen3Moe / Qwen2Moe, llama/model.py LLaMAForCausalLM for Mixtral; quantization/layers.py for
# the scale names). tests/test_engines.py checks each exists in written checkpoints for every precision and TP.
GEMM_TENSORS = {"bf16": ("weight",), "fp8": ("weight", "weights_scaling_factor", "activation_scaling_factor"),
                "nvfp4": ("weight", "weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor")}


def target_weight_names(cfg: BeamConfig, precision: str, kv_cache: str) -> set[str]:
    """The tensor names the target engine's model class loads (per rank file)."""
    names = {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}
    for i in range(cfg.num_hidden_layers):
        p = f"transformer.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_layernorm.weight", p + "mlp.router.weight"}
        gemms = ["attention.qkv", "attention.dense", "mlp.fc", "mlp.proj"]
        if cfg.shared_expert_intermediate_size:
            gemms += ["mlp.shared_expert.fc", "mlp.shared_expert.proj"]
            names.add(p + "mlp.shared_expert_gate.weight")
        names |= {f"{p}{g}.{t}" for g in gemms for t in GEMM_TENSORS[precision]}
        if cfg.use_qk_norm:
            names |= {p + "attention.q_layernorm.weight", p + "attention.k_layernorm.weight"}
        if cfg.qkv_bias:
            names.add(p + "attention.qkv.bias")
        if kv_cache == "fp8":
            names.add(p + "attention.kv_cache_scaling_factor")
    return names


# ---- the plugin library --------------------------------------------------------------------------------------

def cuda_archs() -> str:
    """CMake BEAMTRT_CUDA_ARCHS for the GPUs on this host (arch-specific 'a' targets on Hopper and Blackwell)."""
    import torch

    archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}{minor}{'a' if major >= 9 else ''}" for major, minor in archs)


def header_version(root: Path) -> tuple[int, ...] | None:
    """(major, minor, patch) of the TensorRT headers under root/include, or None where NvInferVersion.h says none."""
    try:
        text = (root / "include" / "NvInferVersion.h").read_text()
    except OSError:
        return None
    parts = [re.search(rf"#define\s+(?:TRT|NV_TENSORRT)_{part}(?:_ENTERPRISE)?\s+(\d+)", text)
             for part in ("MAJOR", "MINOR", "PATCH")]
    return tuple(int(m.group(1)) for m in parts) if all(parts) else None


def tensorrt_version() -> tuple[int, ...] | None:
    """(major, minor, patch) of the installed TensorRT, or None when it is not importable here."""
    try:
        import tensorrt
    except Exception:  # not installed, or its import fails without its libraries
        return None
    return tuple(int(x) for x in re.findall(r"\d+", str(getattr(tensorrt, "__version__", "")))[:3]) or None


def check_plugin_toolchain(tensorrt_root: str) -> str:
    """What the plugin library's build needs (TensorRT headers of the running release, cmake), checked before a build's
    first stage: it is built last, after calibration. Returns the TensorRT root."""
    root = tensorrt_root or os.environ.get("TRT_ROOT", "/usr/local/tensorrt")
    if not (Path(root) / "include" / "NvInfer.h").is_file():
        raise EngineError(f"no TensorRT headers in {root}/include (pass --tensorrt-root or set TRT_ROOT): the "
                          "drafter engine needs the beamtrt plugin library")
    headers, runtime = header_version(Path(root)), tensorrt_version()
    if headers and runtime and headers[0] != runtime[0]:  # ILogger / ILoggerFinder changed layout between majors
        raise EngineError(f"the TensorRT headers in {root}/include are {'.'.join(map(str, headers))} but this "
                          f"process runs TensorRT {'.'.join(map(str, runtime))}: a plugin library built against "
                          "another major version's headers crashes when it logs (pass --tensorrt-root of the same "
                          "release)")
    if shutil.which("cmake") is None:
        raise EngineError("cmake not found: the drafter engine needs the beamtrt plugin library, which cmake builds "
                          "(pip install cmake)")
    return root


def build_plugin_library(out_dir: Path, tensorrt_root: str) -> Path:
    """cmake-build plugins/ (target beamtrt_plugins) and copy the library into out_dir; returns its path."""
    root = check_plugin_toolchain(tensorrt_root)
    with tempfile.TemporaryDirectory(prefix="beamtrt-plugins-") as tmp:
        for cmd in (["cmake", "-S", str(PLUGINS_SOURCE), "-B", tmp, f"-DTensorRT_ROOT={root}",
                     f"-DBEAMTRT_CUDA_ARCHS={cuda_archs()}"],
                    ["cmake", "--build", tmp, "--target", "beamtrt_plugins", "-j"]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise EngineError(f"building the plugin library failed ({' '.join(cmd[:2])}): "
                                  f"{child_error(done.stdout + done.stderr, done.returncode)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        lib = out_dir / "libbeamtrt_plugins.so"
        shutil.copy2(Path(tmp) / "libbeamtrt_plugins.so", lib)
    return lib


# ---- the target engine ---------------------------------------------------------------------------------------

def mark_taps(model, layer_ids: tuple[int, ...], dtype: str) -> None:
    """Make TensorRT-LLM decoder layers `layer_ids` mark their output hidden states as engine outputs
    `beamtrt_tap_<i>` ([num_tokens, H], every token of the step). The layers keep their class's parameters and
    names: each tapped instance's class is swapped for a subclass whose forward marks the output."""
    layers = model.transformer.layers
    for i in layer_ids:
        layer = layers[i]
        layer.__class__ = _tapped_class(type(layer))
        layer.beamtrt_tap = (TAP_OUTPUT.format(i), dtype)


_TAPPED: dict[type, type] = {}


def _tapped_class(cls: type) -> type:
    if cls not in _TAPPED:
        def forward(self, *args, **kwargs):
            out = cls.forward(self, *args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out  # (hidden, presents) when use_cache
            hidden.mark_output(*self.beamtrt_tap)
            return out
        _TAPPED[cls] = type(f"Tapped{cls.__name__}", (cls,), {"forward": forward})
    return _TAPPED[cls]


def build_target(ckpt_dir: Path, out_dir: Path, rank: int, precision: str, taps: tuple[int, ...],
                 settings: EngineSettings) -> Path:
    """One rank's target engine from our TensorRT-LLM checkpoint (what `trtllm-build` does for that rank)."""
    import torch
    from tensorrt_llm.builder import BuildConfig, build
    from tensorrt_llm.models import MODEL_MAP
    from tensorrt_llm.models.modeling_utils import SpeculativeDecodingMode

    config = json.loads((ckpt_dir / "config.json").read_text())
    arch = config["architecture"]
    if arch not in MODEL_MAP:
        raise EngineError(f"TensorRT-LLM {trtllm_version()} has no model class for {arch}")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    hook = None
    if precision == "nvfp4":
        def interleave(scale):  # TensorRT-LLM's own swizzle of FP4 block scales (its MoE weight wrapper's call)
            return torch.ops.trtllm.block_scale_interleave(scale.view(torch.uint8).cpu().contiguous())
        hook = functools.partial(moe_block_scales, interleave=interleave)
    model = MODEL_MAP[arch].from_checkpoint(str(ckpt_dir), rank=rank, preprocess_weights_hook=hook)
    mark_taps(model, taps, config["dtype"])
    build_config = BuildConfig(
        max_batch_size=settings.max_batch_size, max_input_len=settings.max_seq_len,
        max_seq_len=settings.max_seq_len, max_num_tokens=settings.max_num_tokens, max_beam_width=1,
        max_draft_len=settings.block_size - 1,
        speculative_decoding_mode=SpeculativeDecodingMode.DRAFT_TOKENS_EXTERNAL)
    plugins = build_config.plugin_config
    plugins.gemm_plugin = GEMM_PLUGIN[precision]
    plugins.use_paged_context_fmha = True  # a verified block is a context chunk over the cached prefix
    plugins.remove_input_padding = True
    plugins.paged_kv_cache = True
    engine = build(model, build_config)
    engine.save(str(out_dir))
    return out_dir / f"rank{rank}.engine"


# ---- the drafter engine --------------------------------------------------------------------------------------

def build_drafter(drafter_dir: Path, target_dir: Path, out_dir: Path, rank: int, plugin_lib: Path,
                  settings: EngineSettings) -> Path:
    """One rank's DFlash2 drafter engine: our network (beamtrt.build.drafter_net) with the two plugins. Its
    config.json is ours (`drafter_net.NetConfig`): the trt backend, not TensorRT-LLM's runtime, drives it."""
    import tensorrt as trt
    import torch
    from tensorrt_llm.builder import Builder
    from tensorrt_llm.network import net_guard

    from beamtrt.build import drafter_net, plugins

    torch.cuda.set_device(rank % torch.cuda.device_count())
    plugins.load_library(plugin_lib)
    net_cfg = drafter_net.NetConfig.from_checkpoints(drafter_dir, target_dir, settings)
    model = drafter_net.DFlash2Network(net_cfg, rank, drafter_net.rank_weights(drafter_dir, target_dir, rank, net_cfg))
    builder = Builder()
    builder_config = builder.create_builder_config(precision=net_cfg.dtype, strongly_typed=True)
    # the windowed-attention plugin's ring outputs alias its ring inputs (IPluginV3OneBuildV2::getAliasedInput),
    # which TensorRT honours only with this preview feature on
    builder_config.trt_builder_config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    network = builder.create_network()
    network.plugin_config.dtype = net_cfg.dtype
    network.plugin_config.gemm_plugin = None  # plain TensorRT GEMMs: a few block rows per step
    if net_cfg.tp_size > 1:
        network.plugin_config.set_nccl_plugin(net_cfg.dtype)
    with net_guard(network):
        model(**model.prepare_inputs())
    try:
        serialized = builder.build_engine(network, builder_config)
    except AssertionError:  # TensorRT-LLM's Builder asserts when TensorRT returns no engine
        serialized = None
    if serialized is None:
        raise EngineError(f"TensorRT could not build the drafter engine for rank {rank} (see its log)")
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = out_dir / f"rank{rank}.engine"
    engine.write_bytes(bytes(serialized))
    if rank == 0:
        (out_dir / "config.json").write_text(json.dumps(asdict(net_cfg), indent=2) + "\n")
    return engine
