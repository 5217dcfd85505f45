"""The build pipeline: calibrate → quantize and write TensorRT-LLM checkpoints → engines, idempotent and atomic.

Work happens in a temporary directory beside the output, renamed into place at the end, so a failure leaves no
half-written output. A stage whose inputs hash to what the existing manifest recorded, and whose files are intact,
is reused (hard-linked) instead of run.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from beamtrt.checkpoint import manifest as mf
from beamtrt.checkpoint import trtllm
from beamtrt.checkpoint.hf import CheckpointReader, followed, replace_dir, staging, write_json
from beamtrt.checkpoint.stream import nbytes
from beamtrt.checkpoint.trtllm_files import write_checkpoint
from beamtrt.cli_util import size_text
from beamtrt.config import BeamConfig, BuildConfig, DrafterConfig, EngineSettings, drafter_block_error, generation_eos
from beamtrt.errors import CheckpointError, ConfigError
from beamtrt.prompts import has_tokenizer, read_chat_lines

OLD_SETTINGS = EngineSettings(max_seq_len=32768).to_json()  # a build's that predates recording them (the defaults)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Plan:
    """Everything checked before any output exists: configs, mapping, name tables, source tensors, stage keys."""

    def __init__(self, bc: BuildConfig):
        from beamtrt.models.beam import hf_tensor_specs
        from beamtrt.models.dflash2 import drafter_tensor_specs, read_draft_vocab

        self.target_cfg = BeamConfig.from_file(bc.model / "config.json")
        positions = self.target_cfg.max_position_embeddings  # the engines' default and most --max-seq-len
        if bc.engine.max_seq_len is None:
            bc = replace(bc, engine=replace(bc.engine, max_seq_len=positions))
        elif bc.engine.max_seq_len > positions:
            raise ConfigError(f"--max-seq-len {bc.engine.max_seq_len} is past the target's {positions} positions "
                              f"(max_position_embeddings in {bc.model / 'config.json'}); leave it out for {positions}")
        self.bc = bc
        generation_eos(bc.model, self.target_cfg.vocab_size)  # the runtime stops on its ids: a bad file, named now
        self.mapping = trtllm.Mapping(bc.tp, bc.moe_ep)
        self.target_units = trtllm.target_units(self.target_cfg, self.mapping)
        if bc.precision == "nvfp4":
            for unit in self.target_units:
                if isinstance(unit, trtllm.Linear) and unit.shape[1] % 16:
                    raise ConfigError(f"NVFP4 needs each rank's input dim divisible by 16: {unit.name} has "
                                      f"{unit.shape[1]} at TP {bc.tp}")
        self.target_reader = CheckpointReader(bc.model)
        hf_specs = hf_tensor_specs(self.target_cfg)
        self.target_reader.validate({n: (shape, None) for n, (shape, _, _) in hf_specs.items()},
                                    allow_unexpected=("lm_head.weight",) if self.target_cfg.tie_word_embeddings else ())
        self.dtype = _read_dtype(self.target_reader, bc.model, "model.embed_tokens.weight", "its embedding's")
        # the drafter against a target whose config its own weights confirmed (not blamed for the target's config)
        self.drafter_cfg = DrafterConfig.from_file(bc.drafter / "config.json")
        try:
            self.drafter_cfg.check_target(self.target_cfg)
        except ConfigError as err:
            raise ConfigError(f"drafter {bc.drafter} does not fit target {bc.model}: {err}") from None
        if why := drafter_block_error(bc.engine.block_size, self.drafter_cfg.block_size):
            raise ConfigError(why)
        self.drafter_units = trtllm.drafter_units(self.drafter_cfg, self.mapping)
        self.drafter_reader = CheckpointReader(bc.drafter)
        d_specs = drafter_tensor_specs(self.drafter_cfg, v1=self.drafter_cfg.version == 1)
        self.drafter_reader.validate({n: (shape, None) for n, (shape, _, _) in d_specs.items()})
        read_draft_vocab(bc.drafter, self.drafter_cfg)  # a bad one fails here, before any output exists
        self.drafter_dtype = _read_dtype(self.drafter_reader, bc.drafter, "fc.weight", "its fc's")
        self.target_specs = trtllm.unit_specs(self.target_units, bc.precision, self.dtype, bc.kv_cache,
                                              self.target_cfg.num_hidden_layers)  # each rank file's tensors
        self.drafter_specs = trtllm.unit_specs(self.drafter_units, bc.drafter_precision, self.drafter_dtype)
        prompts = bc.calib_prompts or _default_prompts()
        tokenizer = has_tokenizer(bc.model)
        if bc.needs_calibration or bc.calib_prompts or tokenizer:  # a bad prompt file fails here, before any output
            numbered = read_chat_lines(prompts)                    # exists (even one not needed)
        self.calib_ids = None  # the calibration prompts' token ids; None: random ids (a checkpoint with no tokenizer)
        if tokenizer:  # copied into the build for decoding and Triton: one that cannot encode a chat fails the build
            from beamtrt.quant.calibrate import tokenize  # now (a bf16 one built, then they failed)

            self.calib_ids = tokenize(bc.model, [chat for _, chat in numbered],
                                      bc.calib_samples if bc.needs_calibration else 1, self.target_cfg.vocab_size)
            empty = next((i for i, ids in enumerate(self.calib_ids) if not ids.numel()), None)
            if empty is not None:  # (a tokenizer with no chat template and no BOS token, and an empty prompt)
                raise ConfigError(f"{prompts}:{numbered[empty % len(numbered)][0]}: this calibration prompt is no "
                                  f"tokens at all with {bc.model}'s tokenizer; give it some text")
        target_files = mf.model_files(bc.model) + _tokenizer_files(bc.model)  # calibration tokenizes its prompts
        drafter_files = mf.model_files(bc.drafter)
        drafter_fp8 = bc.drafter_precision == "fp8"
        digest = functools.cache(mf.sha256_file)  # each input read once, however many stages it keys (a TB on Beam)

        def calibration(drafter: bool) -> str:  # what the calibrate stage's ranges come from: the target's, + drafter's
            return mf.hash_inputs("calibrate", bc.calib_samples, drafter, bc.engine.block_size if drafter else None,
                                  files=target_files + [prompts] + (drafter_files if drafter else []), digest=digest)

        self.keys = {"calibrate": calibration(drafter_fp8) if bc.needs_calibration else None}
        self.keys["drafter"] = mf.hash_inputs("drafter", bc.drafter_precision, self.mapping.to_json(),
                                              self.keys["calibrate"] if drafter_fp8 else None, files=drafter_files,
                                              digest=digest)
        # the target's scales come from its own ranges alone (a bf16 one with a bf16 KV cache: from none), whatever
        # the drafter's precision: changing that recalibrates, but the target's files stay as they were
        ranges = calibration(False) if bc.precision != "bf16" or bc.kv_cache == "fp8" else None
        self.keys["target"] = mf.hash_inputs("target", bc.precision, bc.kv_cache, self.mapping.to_json(), ranges,
                                             files=target_files, digest=digest)
        from beamtrt.build import engine

        self.engines_why = engine.engine_support() or engine.unsupported(self.target_cfg) or (
            engine.precision_unsupported(bc.precision, bc.kv_cache)) or engine.drafter_unsupported(self.drafter_cfg)
        arch = engine.cuda_archs() if self.engines_why is None else None  # what the plugin library is built for
        self.keys["engines"] = mf.hash_inputs("engines", self.keys["target"], self.keys["drafter"],
                                              bc.engine.to_json(), engine.trtllm_version(), arch,
                                              files=engine.plugin_sources())


def _read_dtype(reader: CheckpointReader, path: Path, name: str, whose: str) -> torch.dtype:
    """The dtype a checkpoint's rank files are written in: its tensor `name`'s, one of trtllm.DTYPE_NAMES (the
    target's and the drafter's alike: a float64 drafter was written in bf16)."""
    dtype = reader.dtype(name)
    if dtype not in trtllm.DTYPE_NAMES:
        raise CheckpointError(f"{path}: unsupported weight dtype {dtype} ({whose}; a build reads "
                              f"{', '.join(trtllm.DTYPE_NAMES.values())})")
    return dtype


def _default_prompts() -> Path:
    from beamtrt.quant.calibrate import default_prompts_path
    return default_prompts_path()


def build(bc: BuildConfig, progress: bool = True) -> list[str]:
    """Run the pipeline into bc.out; returns the validator's summary of the result."""
    plan = Plan(bc)
    bc = plan.bc  # its engine settings resolved
    old = _old_manifest(bc)
    reusable = {name: stage for name, stage in (old or {}).get("stages", {}).items()
                if stage.get("key") == plan.keys.get(name) and stage.get("status") in ("ran", "reused")
                and mf.stage_outputs_intact(bc.out, stage)}
    stages = ("calibrate", "target", "drafter") + (("engines",) if plan.engines_why is None else ())
    needed = [n for n in stages if plan.keys.get(n) and n not in reusable]
    if old and (old.get("engines") or {}).get("settings", OLD_SETTINGS) != bc.engine.to_json():
        needed.append("engines (settings)")  # recorded in the manifest even where no engine is built
    if old is not None and not needed:
        from beamtrt.checkpoint.validate import validate

        try:
            hashed = all(n in reusable for n, stage in old.get("stages", {}).items() if stage.get("files"))
            summary = validate(bc.out, weights_hashed=hashed)  # each stage's files hashed above: not read again
        except CheckpointError as e:  # e.g. a file the manifest does not list: with --force it is written again below,
            if not bc.force:          # every stage reused
                raise CheckpointError(f"{e}; every stage of {bc.out} is up to date, but the output does not validate: "
                                      "mend that, or pass --force to write it again") from None
        else:
            log(f"{bc.out}: up to date (every stage's inputs and outputs match {mf.MANIFEST}); nothing to do")
            return summary
    if old is not None and not bc.force and needed:
        was = old.get("stages", {}).get(needed[0]) or {}
        damaged = was.get("key") is not None and was.get("key") == plan.keys.get(needed[0])  # same inputs, bad files
        changed = ", ".join(_changed(old, bc)) or (  # else an input's contents changed
            f"stage {needed[0]} differs: {STAGE_INPUTS.get(needed[0], 'its inputs')} changed")
        raise ConfigError(f"{bc.out} already exists and " + (
            f"files of its stage {needed[0]} were changed or removed since it was built" if damaged else
            f"was built from other inputs or settings ({changed})") + "; pass --force to replace it")
    if "engines" in needed:  # built last, after calibration: what the plugin library's build needs is checked first
        from beamtrt.build import engine

        engine.check_plugin_toolchain(bc.engine.tensorrt_root)
    where = followed(bc.out).absolute().parent  # the output's file system: its deepest folder there before the build
    while not where.exists():
        where = where.parent
    # staging removes a killed build's leftovers (their space is free again), and refuses an output that another
    # build made since the checks above
    with staging(bc.out, None if bc.force else "pass --force to replace it") as tmp:
        _check_space(plan, reusable, where)
        summary = _run(plan, tmp, reusable, progress)
        replace_dir(tmp, bc.out)
    return [line.replace(str(tmp), str(bc.out)) for line in summary]


# what a stage's key holds besides the flags _changed names, for the refusal where only that changed
STAGE_INPUTS = {"calibrate": "the target's or the drafter's files, or the calibration prompts",
                "target": "the target's files", "drafter": "the drafter's files",
                "engines": "the plugin sources, the TensorRT-LLM version or the GPU"}


def _changed(old: dict, bc: BuildConfig) -> list[str]:
    """The settings whose values differ from those `old`, an earlier build's manifest (and its calibration.json),
    records ("--tp 2 (now 1)"). Not the sources: the stages key their contents, which another spelling of the same
    path does not change."""
    now = {**{f"engines.settings.{k}": v for k, v in bc.engine.to_json().items()}, "precision": bc.precision,
           "kv_cache": bc.kv_cache, "drafter_precision": bc.drafter_precision, "mapping.tp_size": bc.tp,
           "mapping.moe_ep_size": bc.moe_ep}
    flags = {"mapping.tp_size": "tp", "mapping.moe_ep_size": "moe-ep"}
    changed = [f"--{flags.get(key, key.split('.')[-1]).replace('_', '-')} {was} (now {value})"
               for key, value in now.items() if (was := mf.field(old, key, None)) is not None and was != value]
    try:
        samples = json.loads((bc.out / "calibration.json").read_text())["samples"]
    except (OSError, ValueError, KeyError, TypeError):  # none (a build without calibration), or not readable
        samples = None
    if bc.needs_calibration and samples is not None and samples != bc.calib_samples:
        changed.append(f"--calib-samples {samples} (now {bc.calib_samples})")
    return changed


def _check_space(plan: Plan, reusable: dict, where: Path) -> None:
    """Before calibration (hours, on a large model): the output's file system (`where`, a folder in it) must hold
    the rank files and tokenizer the build writes, and as much again for engines, which hold the same weights. Reused
    stages are hard links."""
    bc = plan.bc
    sizes = {name: bc.tp * sum(map(nbytes, specs.values()))
             for name, specs in (("target", plan.target_specs), ("drafter", plan.drafter_specs))}
    sizes["target"] += sum(p.stat().st_size for p in _tokenizer_files(bc.model))  # copied beside the target
    parts = {name: size for name, size in sizes.items() if name not in reusable}
    if plan.engines_why is None and "engines" not in reusable:
        parts["engines"] = sum(sizes.values())
    need, free = sum(parts.values()), shutil.disk_usage(where).free
    if need > free:
        what = " + ".join(f"{name} {size_text(size)}" for name, size in parts.items())
        raise ConfigError(f"{bc.out}: the build writes about {size_text(need)} ({what}) and {where} has "
                          f"{size_text(free)} free: free some space or write the build elsewhere")


def _old_manifest(bc: BuildConfig) -> dict | None:
    if not bc.out.exists() or (bc.out.is_dir() and not any(bc.out.iterdir())):
        return None
    if not mf.looks_built(bc.out):  # --force replaces a build, never a folder of anything else
        stray = sorted(p.name for p in bc.out.iterdir() if p.name not in mf.BUILD_ENTRIES)
        why = f"it holds {stray[0]}, which a build does not write" if (bc.out / mf.MANIFEST).is_file() else \
            f"no {mf.MANIFEST}"
        raise ConfigError(f"{bc.out} exists and is not a build output ({why}); choose another --out, or empty it "
                          "first")
    try:
        return mf.read_manifest(bc.out)
    except CheckpointError:
        if bc.force:
            return {}
        raise


def _reuse(name: str, stage: dict, src: Path, dst: Path) -> dict:
    for rel in stage["files"]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src / rel, dst / rel)
        except OSError:
            shutil.copy2(src / rel, dst / rel)
    log(f"{name}: reused (inputs unchanged)")
    return {**stage, "status": "reused"}


def _run(plan: Plan, tmp: Path, reusable: dict, progress: bool) -> list[str]:
    bc, stages = plan.bc, {}
    amax: dict[str, float] = {}
    drafter_amax: dict[str, float] = {}
    if plan.keys["calibrate"] is None:
        stages["calibrate"] = {"status": "skipped", "reason": "bf16 weights and KV cache need no calibration"}
    elif "calibrate" in reusable:
        stages["calibrate"] = _reuse("calibrate", reusable["calibrate"], bc.out, tmp)
    else:
        stages["calibrate"] = _stage(plan, tmp, "calibrate", lambda: _calibrate(plan, tmp, progress))
    if plan.keys["calibrate"] is not None:
        calibration = json.loads((tmp / "calibration.json").read_text())
        amax, drafter_amax = calibration["amax"], calibration.get("drafter_amax", {})
    for name, fn in (("target", lambda: _write_target(plan, tmp / "target", amax, progress)),
                     ("drafter", lambda: _write_drafter(plan, tmp / "drafter", drafter_amax, progress))):
        stages[name] = _reuse(name, reusable[name], bc.out, tmp) if name in reusable else _stage(plan, tmp, name, fn)
    if plan.engines_why is not None:
        stages["engines"] = {"status": "skipped", "key": plan.keys["engines"], "reason": plan.engines_why}
    elif "engines" in reusable:
        stages["engines"] = _reuse("engines", reusable["engines"], bc.out, tmp)
    else:
        stages["engines"] = _stage(plan, tmp, "engines", lambda: _build_engines(plan, tmp, progress))
    from beamtrt.checkpoint.validate import validate

    manifest = _manifest(plan, stages)
    mf.write_manifest(tmp, manifest)
    return validate(tmp)


def _stage(plan: Plan, tmp: Path, name: str, fn) -> dict:
    start = time.perf_counter()
    files = fn()
    seconds = time.perf_counter() - start
    log(f"{name}: done in {seconds:.1f} s")
    return {"status": "ran", "key": plan.keys[name], "seconds": round(seconds, 3),
            "files": mf.file_hashes(tmp, files)}


def _calibrate(plan: Plan, tmp: Path, progress: bool) -> list[Path]:
    from beamtrt.quant import calibrate as cal

    bc = plan.bc
    if plan.calib_ids is not None:
        sequences = plan.calib_ids
        source = str(bc.calib_prompts or "packaged calibration prompts")
    else:
        sequences = cal.random_tokens(plan.target_cfg.vocab_size, bc.calib_samples)
        source = "random token ids (the checkpoint has no tokenizer)"
    drafter_fp8 = bc.drafter_precision == "fp8"
    result = cal.calibrate(bc.model, plan.target_cfg, sequences, progress=progress,
                           taps=plan.drafter_cfg.target_layer_ids if drafter_fp8 else ())
    record = {"source": source, "samples": len(sequences), "tokens": int(sum(len(s) for s in sequences)),
              "amax": result.amax}
    if drafter_fp8:
        record["drafter_amax"] = cal.calibrate_drafter(bc.drafter, bc.model, plan.target_cfg, sequences, result.taps,
                                                       bc.engine.block_size)
    for ranges in (record["amax"], record.get("drafter_amax", {})):
        bad = [k for k, v in ranges.items() if not (v >= 0 and v < float("inf"))]
        if bad:
            raise CheckpointError(f"calibration produced no usable range for {bad[0]} (amax {ranges[bad[0]]}); "
                                  "check the model's weights")
        if zero := [k for k, v in ranges.items() if v == 0]:  # e.g. after a pruned (all-zero) layer
            log(f"warning: calibration never saw {zero[0]} non-zero" + (f" (nor {len(zero) - 1} more)" if zero[1:]
                else "") + "; its scale is the format's largest value's, as modelopt's export does (more or other "
                "calibration prompts may reach it)")
    out = tmp / "calibration.json"
    write_json(out, record)
    return [out]


def _progress(units: list, desc: str, progress: bool):
    if not progress:
        return units
    from tqdm import tqdm
    return tqdm(units, desc=desc, unit="tensor")


def _warn(progress: bool):
    """Where a stage's warnings go: above its progress bar, if it draws one."""
    if not progress:
        return log
    from tqdm import tqdm
    return lambda line: tqdm.write(line, file=sys.stderr)


def _write_target(plan: Plan, out: Path, amax: dict[str, float], progress: bool) -> list[Path]:
    bc, cfg = plan.bc, plan.target_cfg
    out.mkdir()
    config = trtllm.target_config(cfg, plan.mapping, bc.precision, bc.kv_cache, plan.dtype)
    items = trtllm.produce(_progress(plan.target_units, f"target {bc.precision}", progress),
                           plan.target_reader.get, plan.mapping, bc.precision, plan.dtype, amax, _warn(progress))
    if bc.kv_cache == "fp8":
        kv = list(trtllm.kv_cache_scales(cfg.num_hidden_layers, amax))
        items = _chain(items, ((r, n, t, None) for n, t in kv for r in range(bc.tp)))
    files = write_checkpoint(out, config, plan.target_specs, bc.tp, items, plan.keys["target"])
    return files + _copy_tokenizer(bc.model, out.parent / "tokenizer")


TOKENIZER_NAMES = frozenset(("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                             "vocab.json", "vocab.txt", "merges.txt", "chat_template.json", "generation_config.json"))
TOKENIZER_SUFFIXES = (".model", ".tiktoken", ".jinja")  # SentencePiece and tiktoken vocabularies, chat templates


def _tokenizer_files(model: Path) -> list[Path]:
    """The source's tokenizer, chat template and generation config (named, not "all but the weights": a checkpoint
    folder may also hold other weight formats, a model card, git's files). Copied into the output, and part of the
    target stage's inputs."""
    return [p for p in sorted(model.iterdir()) if p.is_file() and not p.name.startswith(".") and (
        p.name in TOKENIZER_NAMES or p.suffix in TOKENIZER_SUFFIXES)]


def _copy_tokenizer(model: Path, dst: Path) -> list[Path]:
    """The source's tokenizer files (_tokenizer_files), so the output is self-contained for the runtime and Triton."""
    files = _tokenizer_files(model)
    if not files:
        return []
    dst.mkdir()
    for f in files:
        shutil.copyfile(f, dst / f.name)  # the mode a new file gets (not the source's: a 0600 one hid it from Triton)
    return [dst / f.name for f in files]


def _chain(*iterables):
    for it in iterables:
        yield from it


def _write_drafter(plan: Plan, out: Path, amax: dict[str, float], progress: bool) -> list[Path]:
    out.mkdir()
    precision = plan.bc.drafter_precision
    config = trtllm.drafter_config(plan.drafter_cfg, plan.mapping, plan.drafter_dtype, precision)
    items = trtllm.produce(_progress(plan.drafter_units, f"drafter {precision}", progress), plan.drafter_reader.get,
                           plan.mapping, precision, plan.drafter_dtype, amax, _warn(progress))
    files = write_checkpoint(out, config, plan.drafter_specs, plan.bc.tp, items, plan.keys["drafter"])
    from beamtrt.models.dflash2 import DRAFT_VOCAB_FILE

    vocab = plan.bc.drafter / DRAFT_VOCAB_FILE
    if vocab.exists():  # the token ids the drafter drafts from, as it was trained (models/dflash2.py)
        shutil.copyfile(vocab, out / DRAFT_VOCAB_FILE)
        files.append(out / DRAFT_VOCAB_FILE)
    return files


def _has_tokenizer(stages: dict) -> bool:
    return any(name.startswith("tokenizer/") for name in (stages.get("target", {}).get("files") or {}))


def _build_engines(plan: Plan, tmp: Path, progress: bool) -> list[Path]:
    """The plugin library, then every rank's target and drafter engines (beamtrt.build.engine)."""
    from beamtrt.build import engine

    bc = plan.bc
    lib = engine.build_plugin_library(tmp / engine.PLUGIN_DIR, bc.engine.tensorrt_root)
    files = [lib]
    target_out, drafter_out = tmp / "target" / engine.ENGINE_DIR, tmp / "drafter" / engine.ENGINE_DIR
    for rank in _progress(list(range(bc.tp)), "engines", progress):
        files.append(engine.build_target(tmp / "target", target_out, rank, bc.precision,
                                         plan.drafter_cfg.target_layer_ids, bc.engine))
        files.append(engine.build_drafter(tmp / "drafter", tmp / "target", drafter_out, rank, lib, bc.engine))
    return files + [target_out / "config.json", drafter_out / "config.json"]


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("beamtrt", "torch", "nvidia-modelopt", "tensorrt_llm", "tensorrt"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _engines_record(stage: dict, bc: BuildConfig, taps: tuple[int, ...]) -> dict:
    """manifest["engines"]: where the engines and the plugin library are (null when the stage did not run)."""
    from beamtrt.build import engine

    files = stage.get("files") or {}
    lib = f"{engine.PLUGIN_DIR}/libbeamtrt_plugins.so"
    return {"built": stage["status"] in ("ran", "reused"), "settings": bc.engine.to_json(),
            "target": f"target/{engine.ENGINE_DIR}" if files else None,
            "drafter": f"drafter/{engine.ENGINE_DIR}" if files else None,
            "plugin_library": lib if lib in files else None, "plugin_sha256": files.get(lib),
            "tap_outputs": [engine.TAP_OUTPUT.format(i) for i in (taps if files else ())]}


def _manifest(plan: Plan, stages: dict) -> dict:
    bc, d = plan.bc, plan.drafter_cfg
    files = {name: digest for stage in stages.values() for name, digest in (stage.get("files") or {}).items()}
    return {
        "precision": bc.precision, "kv_cache": bc.kv_cache, "drafter_precision": bc.drafter_precision,
        "mapping": plan.mapping.to_json(),
        "target": {"source": str(bc.model), "architecture": trtllm.target_architecture(plan.target_cfg)[0],
                   "dir": "target", "dtype": trtllm.DTYPE_NAMES[plan.dtype],
                   "tokenizer": "tokenizer" if _has_tokenizer(stages) else None},
        "drafter": {"source": str(bc.drafter), "architecture": trtllm.DRAFTER_ARCHITECTURE, "dir": "drafter",
                    "block_size": bc.engine.block_size, "train_block_size": d.block_size,
                    "target_layer_ids": list(d.target_layer_ids), "mask_token_id": d.mask_token_id,
                    "sliding_window": d.sliding_window},
        "engines": _engines_record(stages["engines"], bc, d.target_layer_ids),
        "versions": _versions(),
        "stages": stages,
        "files": dict(sorted(files.items())),
    }
