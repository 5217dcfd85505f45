"""TensorRT-LLM checkpoint directories on disk: streaming writer, rank-file reader, and the reference model loaded
from one (quantized weights dequantized, activation and KV-cache quantization emulated)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from pathlib import Path

import torch
from beamtrt.checkpoint import trtllm
from beamtrt.checkpoint.hf import read_json, write_json
from beamtrt.checkpoint.stream import SafetensorsError, SafetensorsFile, StreamingSafetensors
from beamtrt.config import BeamConfig, DrafterConfig
from beamtrt.errors import CheckpointError
from beamtrt.quant import fp8, nvfp4


_SCALES = ("scaling_factor", "scaling_factor_2")


def check_values(file: Path, name: str, t: torch.Tensor) -> None:
    """Rank-file values a build never writes: NaN or Inf anywhere, a scale that is zero or negative."""
    if not t.is_floating_point():
        return
    wide = t.to(torch.float32)
    if not bool(torch.isfinite(wide).all()):
        raise CheckpointError(f"{file}: tensor {name!r} has NaN or Inf values")
    if name.endswith(_SCALES) and not bool((wide > 0).all()):
        raise CheckpointError(f"{file}: scale tensor {name!r} has zero or negative entries")


def rank_file(path: Path, rank: int) -> Path:
    return Path(path) / f"rank{rank}.safetensors"


# What a rank file's safetensors metadata says of the build that wrote it: its stage key and its rank. Checked at every
# start against the manifest (validate.agree), which hashes every file but the weights: a rank file copied from
# another build or from another rank is named before it loads (it ran, giving other tokens).
STAMP_KEY, STAMP_RANK = "beamtrt.stage_key", "beamtrt.rank"


def write_checkpoint(path: str | Path, config: dict, specs: dict[str, trtllm.Spec], tp: int,
                     items: Iterable[tuple[int, str, torch.Tensor, int | None]],
                     stage_key: str | None = None) -> list[Path]:
    """Write config.json and rank{r}.safetensors from (rank, name, tensor, slot) items into the existing directory
    `path`, one piece in memory at a time (a build's stamped with its stage key and rank). Every declared byte must be
    written."""
    path = Path(path)
    files = [StreamingSafetensors(rank_file(path, r), specs, stage_key and {STAMP_KEY: stage_key, STAMP_RANK: str(r)})
             for r in range(tp)]
    try:
        for rank, name, tensor, slot in items:
            files[rank].write(name, tensor, slot)
        for f in files:
            f.close()
    except BaseException:
        for f in files:
            f.abort()
        raise
    write_json(path / "config.json", config)
    return [path / "config.json"] + [f.path for f in files]


class TrtllmCheckpoint:
    """A TensorRT-LLM checkpoint directory: its config, mapping and precision, and tensors per rank."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such TensorRT-LLM checkpoint directory")
        self.config = read_json(self.path / "config.json", "TensorRT-LLM config.json")
        source = str(self.path / "config.json")
        for key in ("mapping", "quantization", "beam_config", "drafter_config"):
            if not isinstance(self.config.get(key) or {}, dict):
                raise CheckpointError(f"{source}: {key!r} must be a JSON object, got "
                                      f"{type(self.config[key]).__name__}")
        self.mapping = trtllm.Mapping.from_json(self.config.get("mapping") or {}, source)
        algo = (self.config.get("quantization") or {}).get("quant_algo")
        precisions = {v: k for k, v in trtllm.QUANT_ALGO.items()}
        if not isinstance(algo, (str, type(None))) or algo not in precisions:  # a list is unhashable
            raise CheckpointError(f"{source}: unsupported quant_algo {algo!r} (expected one of FP8, NVFP4 or none)")
        self.precision = precisions[algo]
        self.kv_cache = "fp8" if (self.config.get("quantization") or {}).get("kv_cache_quant_algo") == "FP8" else "auto"
        self.dtype = trtllm.tensor_dtype(source, self.config.get("dtype", ""))
        self._files: dict[int, SafetensorsFile] = {}
        self._specs: dict[str, trtllm.Spec] | None = None

    def open(self, rank: int):
        if rank not in self._files:
            file = rank_file(self.path, rank)
            if file.is_dir():
                raise CheckpointError(f"{file}: a directory, not a rank file")
            if not file.is_file():
                raise CheckpointError(f"{file}: missing rank file (the checkpoint has tp_size {self.mapping.tp_size})")
            try:
                self._files[rank] = SafetensorsFile(file)
            except (SafetensorsError, OSError) as err:
                raise CheckpointError(f"{file}: not a valid safetensors file: {' '.join(str(err).split())}") from None
        return self._files[rank]

    def get(self, rank: int, name: str) -> torch.Tensor:
        """One rank's tensor, checked against the name table: shape, dtype, finite values, positive scales."""
        handle, file = self.open(rank), rank_file(self.path, rank)
        if name not in handle.keys():
            raise CheckpointError(f"{file}: missing tensor {name!r}")
        try:
            t = handle.get_tensor(name)
        except (SafetensorsError, OSError) as err:
            raise CheckpointError(f"{file}: cannot read {name!r}: {' '.join(str(err).split())}") from None
        if self._specs is None:
            self._specs = self.specs()
        if name in self._specs:
            shape, dtype = self._specs[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise CheckpointError(f"{file}: tensor {name!r} is {tuple(t.shape)} {t.dtype}, expected "
                                      f"{tuple(shape)} {dtype}")
        check_values(file, name, t)
        return t

    def is_drafter(self) -> bool:
        return self.config.get("architecture") == trtllm.DRAFTER_ARCHITECTURE

    def beam_config(self) -> BeamConfig:
        if not self.config.get("beam_config"):
            raise CheckpointError(f"{self.path / 'config.json'}: not a beamtrt target checkpoint (no beam_config)")
        return BeamConfig.from_dict(self.config["beam_config"], source=str(self.path / "config.json"))

    def drafter_config(self) -> DrafterConfig:
        if not self.is_drafter():
            raise CheckpointError(f"{self.path / 'config.json'}: not a {trtllm.DRAFTER_ARCHITECTURE} checkpoint")
        if not self.config.get("drafter_config"):
            raise CheckpointError(f"{self.path / 'config.json'}: a drafter checkpoint without its drafter_config")
        return DrafterConfig.from_dict(self.config["drafter_config"], source=str(self.path / "config.json"))

    def units(self) -> list[trtllm.Unit]:
        if self.is_drafter():
            return trtllm.drafter_units(self.drafter_config(), self.mapping)
        return trtllm.target_units(self.beam_config(), self.mapping)

    def specs(self) -> dict[str, trtllm.Spec]:
        layers = 0 if self.is_drafter() else self.beam_config().num_hidden_layers
        return trtllm.unit_specs(self.units(), self.precision, self.dtype, self.kv_cache, layers)

    def unshard(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the source model, rebuilt from all rank files (see trtllm.unshard)."""
        if self.is_drafter():
            from beamtrt.models.dflash2 import drafter_tensor_specs
            shapes = {n: spec[0] for n, spec in drafter_tensor_specs(self.drafter_config()).items()}
        else:
            from beamtrt.models.beam import hf_tensor_specs
            cfg = self.beam_config()
            shapes = {n: spec[0] for n, spec in hf_tensor_specs(cfg).items()}
            if cfg.tie_word_embeddings:
                shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
        return trtllm.unshard(self.units(), self.get, self.mapping.tp_size, self.precision, shapes)

    def scale(self, rank: int, name: str) -> torch.Tensor:
        return self.get(rank, name).float().reshape(-1)[0]


def act_hooks(model) -> dict[str, tuple[object, str]]:
    """Calibration site (TensorRT-LLM module name) -> (our module, hook attribute), for a BeamForCausalLM or a
    DFlash2Drafter (same names in each checkpoint's own namespace).

    Target sites ending in `_cache` are the K / V written to the cache (their ranges give the FP8 KV-cache scales)."""
    sites: dict[str, tuple[object, str]] = {}
    for i, layer in enumerate(model.layers):
        trt = f"transformer.layers.{i}."
        attn = layer.attn if hasattr(layer, "attn") else layer.self_attn
        sites[trt + "attention.qkv"] = (attn, "qkv_in")
        sites[trt + "attention.dense"] = (attn, "o_in")
        sites[trt + "mlp.fc"] = (layer.mlp, "fc_in")
        sites[trt + "mlp.proj"] = (layer.mlp, "proj_in")
        if hasattr(attn, "k_out"):  # the target
            sites[trt + "attention.k_cache"] = (attn, "k_out")
            sites[trt + "attention.v_cache"] = (attn, "v_out")
        shared = getattr(layer.mlp, "shared", None)
        if shared is not None:
            sites[trt + "mlp.shared_expert.fc"] = (shared, "fc_in")
            sites[trt + "mlp.shared_expert.proj"] = (shared, "proj_in")
    return sites


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The reference Beam model run from a TensorRT-LLM target checkpoint: weights un-sharded and dequantized,
    activation quantization (and FP8 KV-cache quantization) emulated at every GEMM input as TensorRT-LLM runs it."""
    from beamtrt.models.beam import BeamForCausalLM, check_fits, load_state

    ckpt = TrtllmCheckpoint(path)
    if ckpt.is_drafter():
        raise CheckpointError(f"{ckpt.path}: is a drafter checkpoint, expected a target")
    cfg = ckpt.beam_config()
    with torch.device("meta"):
        model = BeamForCausalLM(cfg)
    check_fits(ckpt.path, model, dtype, torch.device(device))  # every rank's weights in this one process
    model = model.to_empty(device=device).to(dtype)
    tensors = ckpt.unshard()
    if cfg.tie_word_embeddings:
        tensors = ((n, t) for n, t in tensors if n != "lm_head.weight")
    load_state(model, tensors)
    install_emulation(model, ckpt)
    return model.eval()


def load_drafter_checkpoint(path: str | Path, target, dtype: torch.dtype | None = None):
    """The reference DFlash2 drafter run from a TensorRT-LLM drafter checkpoint over `target` (whose embedding and
    LM head it borrows), with the checkpoint's quantization emulated."""
    from beamtrt.models.dflash2 import _build, check_drafter_target, load_state, read_draft_vocab

    ckpt = TrtllmCheckpoint(path)
    cfg = ckpt.drafter_config()
    check_drafter_target(cfg, target.cfg, ckpt.path)
    model = _build(cfg, target, dtype or target.dtype, target.device)
    load_state(model, ckpt.unshard(), v1=cfg.version == 1)
    model.set_draft_vocab(read_draft_vocab(ckpt.path, cfg))
    install_emulation(model, ckpt)
    return model.eval()


def install_emulation(model, ckpt: TrtllmCheckpoint, rank: int | None = None) -> None:
    """Set the model's activation hooks to the checkpoint's activation (and KV-cache) quantization, with the scales
    of `rank`'s file; None (one process running every rank) reads every rank's copy, which must be the same."""
    def scale(name: str) -> torch.Tensor:
        if rank is not None:
            return ckpt.scale(rank, name)
        first = ckpt.scale(0, name)
        for r in range(1, ckpt.mapping.tp_size):  # each read checks its value (NaN, Inf, zero) too
            if not torch.equal(ckpt.scale(r, name), first):
                raise CheckpointError(f"{rank_file(ckpt.path, r)}: tensor {name!r} differs from rank 0's copy (every "
                                      "rank holds the same one): damaged, rebuild with build/build_engines.py")
        return first

    sites = act_hooks(model)
    if ckpt.precision != "bf16":
        fake = fp8.fake_quant if ckpt.precision == "fp8" else nvfp4.fake_quant_activation
        for unit in ckpt.units():
            if isinstance(unit, trtllm.Linear) and unit.name in sites:
                module, attr = sites[unit.name]
                setattr(module, attr, partial(fake, scale=scale(f"{unit.name}.activation_scaling_factor"))
                        if ckpt.precision == "fp8" else
                        partial(fake, scale_2=scale(f"{unit.name}.activation_scaling_factor")))
    if ckpt.kv_cache == "fp8":
        for site in trtllm.kv_sites(len(model.layers)):
            kv_scale = scale(f"{site}.kv_cache_scaling_factor")
            for kind in ("k", "v"):
                module, attr = sites[f"{site}.{kind}_cache"]
                setattr(module, attr, partial(fp8.fake_quant, scale=kv_scale))
