"""Backends from a build output or a Hugging Face checkpoint: the one place `--backend auto|torch|trt` is decided."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from beamtrt.checkpoint import manifest as mf
from beamtrt.config import BeamConfig, DrafterConfig, drafter_block_error, generation_eos
from beamtrt.errors import CheckpointError, ConfigError

BACKENDS = ("auto", "torch", "trt")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # compute dtypes of the torch backend


@dataclass
class Loaded:
    target: object              # a TargetBackend
    drafter: object | None      # a DrafterBackend, or None for plain decoding
    tokenizer_dir: Path
    backend: str                # "torch" or "trt": what actually runs
    what: str                   # one line for logs: what was loaded
    drafter_dir: Path | None = None  # the drafter checkpoint it came from (None for plain decoding)


def open_build(engine_dir: Path | None, dist) -> dict | None:
    """The manifest of a build_engines.py output (None for a Hugging Face checkpoint: engine_dir None), checked
    against the ranks running it: a build for TP N runs on N ranks or in one process, a checkpoint in one process."""
    if engine_dir is None:
        if dist.size > 1:
            raise ValueError("a Hugging Face checkpoint runs in one process; build TensorRT-LLM checkpoints with "
                             "build/build_engines.py --tp N to run on N ranks")
        return None
    manifest = mf.read_manifest(engine_dir)
    tp_size = manifest["mapping"]["tp_size"]
    if dist.size not in (1, tp_size):
        raise ValueError(f"{engine_dir} was built for tp {tp_size} but {dist.size} ranks are running: start it "
                         f"with mpirun -n {tp_size} (or without mpirun, as one process)")
    from beamtrt.checkpoint.validate import agree

    agree(engine_dir, manifest)  # its small files as built (validate also hashes the weights: too slow for a start)
    tokenizer = build_tokenizer_dir(engine_dir, manifest)
    if not tokenizer.is_dir():
        raise CheckpointError(f"{engine_dir}: the build's tokenizer folder {tokenizer} is missing; rebuild with "
                              "build/build_engines.py")
    return manifest


def build_tokenizer_dir(root: Path, manifest: dict) -> Path:
    """Where a build's tokenizer is: its own tokenizer/ copy, or (older builds) the source checkpoint's."""
    tokenizer = manifest["target"].get("tokenizer")
    return root / tokenizer if tokenizer else Path(manifest["target"]["source"])


def build_context(root: Path, manifest: dict, backend: str) -> int | None:
    """The longest request (prompt, new tokens and a verify block's positions) a build's target runs, from its configs:
    its max_position_embeddings, bounded by the engines' --max-seq-len where they were built (the same command fails
    the same way on either backend; an older build's default, 32768, is past beam-mini's 8192 positions); on TensorRT
    None where an older build kept no engine settings."""
    from beamtrt.checkpoint.trtllm_files import TrtllmCheckpoint

    built = mf.field(manifest, "engines.settings.max_seq_len", None)
    if backend == "trt" and built is None:
        return None
    context = TrtllmCheckpoint(root / manifest["target"]["dir"]).beam_config().max_position_embeddings
    return min(context, built) if built else context


@dataclass(frozen=True)
class Sources:
    """What load_build or load_hf will load, found and checked from configs before any weight is (`find_sources`)."""
    tokenizer_dir: Path
    context: int | None              # the target's context in tokens (`build_context`; None: engines that kept none)
    model_dir: Path | None = None    # the Hugging Face target (None: a build's own)
    drafter_dir: Path | None = None  # its drafter (None: a build's own, or plain decoding)
    drafter_block: int | None = None  # the largest block the drafter drafts (None: plain decoding, or not recorded)

    def inputs(self, engine_dir: Path | None) -> list[tuple[str, Path | None]]:
        """(what, folder) of everything loaded from, for cli_util.outside_inputs (None: not one of these sources)."""
        return [("the build", engine_dir), ("the target", self.model_dir), ("the drafter", self.drafter_dir),
                ("the tokenizer", self.tokenizer_dir)]  # an older build's is its source checkpoint's

    def check_block(self, block_size: int) -> None:
        """A verification block the drafter can draft (at most the block it trained at), or a one-line ConfigError."""
        if self.drafter_block is not None and (why := drafter_block_error(block_size, self.drafter_block)):
            raise ConfigError(why)


def find_sources(engine_dir: Path | None, manifest: dict | None, backend: str, model_dir: str | Path | None,
                 drafter_dir: str | Path | None, spec: bool, no_spec_flag: str = "") -> Sources:
    """The `Sources` of a build (`engine_dir`) or of a Hugging Face target and drafter (`hf_sources`)."""
    if engine_dir is not None:
        return Sources(build_tokenizer_dir(engine_dir, manifest), build_context(engine_dir, manifest, backend),
                       drafter_block=manifest["drafter"].get("train_block_size") if spec else None)
    model_dir, drafter_dir = hf_sources(model_dir, drafter_dir, spec, no_spec_flag)
    context = BeamConfig.from_file(model_dir / "config.json").max_position_embeddings
    block = DrafterConfig.from_file(drafter_dir / "config.json").block_size if drafter_dir else None
    return Sources(model_dir, context, model_dir, drafter_dir, block)


def missing_engines(manifest: dict | None) -> str | None:
    """Why a build has no engines to run (None when its engine stage ran or was reused)."""
    engines = (manifest or {}).get("stages", {}).get("engines", {})
    return None if engines.get("status") in ("ran", "reused") else engines.get("reason", "engine stage not run")


def pick_backend(requested: str, manifest: dict | None, ranks: int = 1) -> tuple[str, str]:
    """(backend, why) for `--backend`, a build manifest (None for a Hugging Face checkpoint) and the number of ranks
    running: engines need one rank per engine, so auto runs a tensor-parallel build in one process on torch."""
    if requested not in BACKENDS:
        raise ConfigError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    no_engines = missing_engines(manifest)
    if requested == "torch":
        return "torch", "requested"
    from beamtrt.build.engine import engine_support

    missing = engine_support()
    tp = manifest["mapping"]["tp_size"] if manifest is not None else 1
    per_engine = None if ranks == tp else f"the engines need {tp} ranks (mpirun -n {tp}), {ranks} running"
    if requested == "trt":
        if manifest is None:
            raise ConfigError("--backend trt runs engines from a build output: pass --engine-dir")
        if no_engines:
            raise ConfigError(f"--backend trt: the build has no engines ({no_engines})")
        if missing:
            raise ConfigError(f"--backend trt: {missing}")
        if per_engine:
            raise ConfigError(f"--backend trt: {per_engine}")
        return "trt", "requested"
    if not no_engines and not missing:
        return ("torch", per_engine) if per_engine else ("trt", "engines and TensorRT-LLM present")
    if manifest is None:
        return "torch", "a Hugging Face checkpoint runs on torch"
    return "torch", (f"no engines in the build ({no_engines})" if no_engines else missing)


def check_device(device: str, backend: str, ranks: int, flag: str = "--device", other: str | None = None) -> None:
    """Refuse a device the torch backend's tensor-parallel ranks would not run on: their shards live in host memory
    (their all-reduces are MPI collectives there), so under mpirun they run on the CPU whatever `device` says.
    `other`: the remedy beside cpu (default: one process, where the command can run without mpirun)."""
    if backend == "torch" and ranks > 1 and torch.device(device).type != "cpu":
        other = other or f"run the build in one process (without mpirun) on {device}"
        raise ConfigError(f"{flag} {device}: the torch backend's tensor-parallel ranks run on the CPU (their shards "
                          f"and all-reduces are in host memory): use cpu, or {other}")


def _stop_on_generation_eos(loaded: Loaded) -> Loaded:
    """The target's end-of-sequence ids: its config.json's, then its generation_config.json's."""
    target = loaded.target
    extra = generation_eos(loaded.tokenizer_dir, target.vocab_size)
    target.eos_token_ids = tuple(dict.fromkeys((*target.eos_token_ids, *extra)))
    return loaded


def load_build(root: Path, manifest: dict, dist, *, backend: str = "torch", dtype: torch.dtype = torch.float32,
               device: str = "cpu", spec: bool = True) -> Loaded:
    """This rank's backends for a build_engines.py output (`backend` already picked by `pick_backend`)."""
    target_dir, drafter_dir = root / manifest["target"]["dir"], root / manifest["drafter"]["dir"]
    tokenizer_dir = build_tokenizer_dir(root, manifest)
    what = f"{root} ({manifest['precision']}, tp {manifest['mapping']['tp_size']}, {dist.size} rank(s))"
    if backend == "trt":
        from beamtrt.runtime.trt_backend import load_engines

        target, drafter = load_engines(root, manifest, dist, spec=spec)
        loaded = Loaded(target, drafter, tokenizer_dir, "trt", what, drafter_dir if spec else None)
        return _stop_on_generation_eos(loaded)
    from beamtrt.runtime.torch_backend import TorchDrafter, TorchTarget

    if dist.size == 1:  # one process: every rank file, un-sharded
        from beamtrt.checkpoint.trtllm_files import load_drafter_checkpoint, load_target

        model = load_target(target_dir, dtype=dtype, device=device)
        drafter = TorchDrafter(load_drafter_checkpoint(drafter_dir, model)) if spec else None
    else:
        from beamtrt.runtime import tp

        model = tp.load_target_shard(target_dir, dist, dtype=dtype)
        drafter = TorchDrafter(tp.load_drafter_shard(drafter_dir, model, dist)) if spec else None
    target = TorchTarget(model)
    target.max_seq_len = build_context(root, manifest, "torch")
    return _stop_on_generation_eos(Loaded(target, drafter, tokenizer_dir, "torch", what,
                                          drafter_dir if spec else None))


def load_hf(model_dir: Path, drafter_dir: Path | None, *, dtype: torch.dtype = torch.float32,
            device: str = "cpu", quiet: bool = False) -> Loaded:
    """The torch backends for a Hugging Face target and its drafter (None: plain decoding), as `hf_sources` found
    and checked them (`quiet`: no loading bar)."""
    from beamtrt.models.beam import load_beam
    from beamtrt.models.dflash2 import load_drafter
    from beamtrt.runtime.torch_backend import TorchDrafter, TorchTarget

    model = load_beam(model_dir, dtype=dtype, device=device, quiet=quiet)
    drafter = TorchDrafter(load_drafter(drafter_dir, model, dtype=dtype, device=device)) if drafter_dir else None
    what = f"{model_dir}, " + (f"drafter {drafter_dir}" if drafter_dir else "no drafter")
    return _stop_on_generation_eos(Loaded(TorchTarget(model), drafter, model_dir, "torch", what, drafter_dir))


def not_a_build(model_dir: Path, remedy: Callable[[Path], str] | None, flag: str = "--model") -> None:
    """--model (`flag`) naming a build_engines.py output, or its target/ or drafter/ (a TensorRT-LLM checkpoint), is
    one line; `remedy` (called with the build) says what to pass instead."""
    build = next((d for d in (model_dir, model_dir.parent) if mf.looks_built(d)), None)  # each read once
    if build is not None:
        what = "a build_engines.py output" if build == model_dir else f"a folder of the build_engines.py output {build}"
        raise CheckpointError(f"{flag} {model_dir}: {what}, not a Hugging Face checkpoint"
                              + (f": pass {remedy(build)}" if remedy else ""))


def hf_sources(model_dir: str | Path | None, drafter_dir: str | Path | None, spec: bool,
               no_spec_flag: str = "", engine_dir_flag: bool = True) -> tuple[Path, Path | None]:
    """(target, drafter) folders for load_hf, checked before any weight is: the target is `model_dir` or beam-mini
    (created on first use, after a bad --drafter is reported), the drafter `drafter_dir` or the default one for the
    target (None without `spec`), and a drafter made for another target is refused. A build_engines.py output given as
    --model is named as one (with --engine-dir offered when the command has it: `engine_dir_flag`)."""
    from beamtrt.models.beam_mini import default_drafter_for, ensure_beam_mini
    from beamtrt.models.dflash2 import drafter_config_for

    if model_dir:
        not_a_build(Path(model_dir), "--engine-dir {}".format if engine_dir_flag else None)
    if spec and drafter_dir:
        not_a_build(Path(drafter_dir), None, "--drafter")
        DrafterConfig.from_file(Path(drafter_dir) / "config.json")
    model_dir = Path(model_dir) if model_dir else ensure_beam_mini()
    if (model_dir / "config.json").is_file():
        target_cfg = BeamConfig.from_file(model_dir / "config.json")
        generation_eos(model_dir, target_cfg.vocab_size)  # a bad one named before any weight loads
        if spec and drafter_dir:
            drafter_config_for(drafter_dir, target_cfg)
        elif spec:
            drafter_dir = default_drafter_for(target_cfg, no_spec_flag)
    return model_dir, Path(drafter_dir) if spec and drafter_dir else None
