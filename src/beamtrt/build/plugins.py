"""The beamtrt TensorRT plugin library (plugins/): load it and add either plugin to a network -- the one place that
knows the plugin names, versions and fields (tensors and attributes: plugins/*/README.md).

TensorRT is imported only inside these functions, so the package imports without it. The library is built by
`cmake -S plugins -B plugins/_build -DTensorRT_ROOT=...` (target `beamtrt_plugins`) and registered with TensorRT's
plugin registry through its `getCreators` entry point; it must be loaded in every process that builds or
deserializes an engine using it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from beamtrt.errors import BeamtrtError

NAMESPACE = "beamtrt"
VERSION = "1"
LIBRARY = "libbeamtrt_plugins.so"
DEFAULT_BUILD = Path(__file__).resolve().parents[3] / "plugins" / "_build"


@dataclass(frozen=True)
class PluginSpec:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fields: tuple[tuple[str, str], ...]  # (attribute, "int32" | "float32"), in the C++ fields() order


BLOCK_SELECTOR = PluginSpec(
    "BeamtrtBlockSelector",
    inputs=("logits", "projected", "anchor_ids", "predecessor_codebook", "successor_codebook", "temperature",
            "top_p", "uniforms"),
    outputs=("draft_ids", "cand_ids", "q"),
    fields=(("top_k", "int32"),))

WINDOWED_ATTENTION = PluginSpec(
    "BeamtrtWindowedAttention",
    inputs=("q", "k", "v", "context_k", "context_v", "start", "count", "ring_k", "ring_v"),
    outputs=("out", "ring_k", "ring_v"),
    fields=(("window", "int32"), ("kv_cache_fp8", "int32"), ("kv_scale", "float32"), ("softmax_scale", "float32")))

PLUGINS = (BLOCK_SELECTOR, WINDOWED_ATTENTION)


class PluginError(BeamtrtError):
    """The plugin library is missing, or TensorRT refused a plugin."""


def load_library(path: str | Path | None = None) -> Path:
    """Register the plugin library with TensorRT's registry (idempotent per process); returns its path."""
    import tensorrt as trt

    lib = Path(path) if path else DEFAULT_BUILD / LIBRARY
    if not lib.is_file():
        raise PluginError(f"{lib}: no plugin library (build it: cmake -S plugins -B plugins/_build "
                          f"-DTensorRT_ROOT=... && cmake --build plugins/_build)")
    registry = trt.get_plugin_registry()
    if registry.get_creator(BLOCK_SELECTOR.name, VERSION, NAMESPACE) is None:
        if registry.load_library(str(lib)) is None:
            raise PluginError(f"{lib}: TensorRT could not load the plugin library")
    return lib


def _add(network, spec: PluginSpec, tensors: list, values: dict):
    """network.add_plugin_v3 of `spec` (a TensorRT INetworkDefinition, ITensor inputs) with its attribute
    `values`; returns the IPluginV3Layer."""
    import numpy as np
    import tensorrt as trt

    if len(tensors) != len(spec.inputs):
        raise PluginError(f"{spec.name} takes {len(spec.inputs)} inputs ({', '.join(spec.inputs)}), got {len(tensors)}")
    creator = trt.get_plugin_registry().get_creator(spec.name, VERSION, NAMESPACE)
    if creator is None:
        raise PluginError(f"{spec.name}: not registered (call beamtrt.build.plugins.load_library first)")
    kinds = {"int32": (np.int32, trt.PluginFieldType.INT32), "float32": (np.float32, trt.PluginFieldType.FLOAT32)}
    fields = [trt.PluginField(name, np.array([values[name]], dtype=kinds[kind][0]), kinds[kind][1])
              for name, kind in spec.fields]
    plugin = creator.create_plugin(spec.name, trt.PluginFieldCollection(fields), trt.TensorRTPhase.BUILD)
    if plugin is None:
        raise PluginError(f"{spec.name}: TensorRT refused the attributes {values} (see its log)")
    return network.add_plugin_v3(tensors, [], plugin)  # unnamed: TensorRT rejects repeated layer names


def add_block_selector(network, logits, projected, anchor_ids, predecessor_codebook, successor_codebook,
                       temperature, top_p, uniforms, *, top_k: int):
    """-> the plugin layer; outputs draft_ids [N, S] int32, cand_ids [N, S, K] int32, q [N, S, K] fp32 (README)."""
    return _add(network, BLOCK_SELECTOR, [logits, projected, anchor_ids, predecessor_codebook, successor_codebook,
                                          temperature, top_p, uniforms], {"top_k": top_k})


def add_windowed_attention(network, q, k, v, context_k, context_v, start, count, ring_k, ring_v, *, window: int,
                           kv_scale: float | None = None, softmax_scale: float = 0.0):
    """-> the plugin layer; outputs out [N, L, Hq, D], ring_k, ring_v (the updated rings, aliasing the inputs);
    kv_scale set = fp8 ring."""
    values = {"window": window, "kv_cache_fp8": int(kv_scale is not None),
              "kv_scale": 1.0 if kv_scale is None else kv_scale, "softmax_scale": softmax_scale}
    return _add(network, WINDOWED_ATTENTION, [q, k, v, context_k, context_v, start, count, ring_k, ring_v], values)
