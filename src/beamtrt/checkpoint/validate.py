"""`python -m beamtrt.checkpoint.validate DIR`: check a build output against its config and manifest, print a summary.

Checks every rank file of the target and drafter checkpoints holds exactly the tensors the name table declares,
with the right shapes and dtypes, finite values and positive scales, and that every file's sha256 matches the
manifest.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m`: import it through beamtrt.entry, which holds Ctrl-C until torch is in
    from beamtrt.entry import run
    raise SystemExit(run(__spec__.name))

from pathlib import Path

import torch

from beamtrt import cli_util
from beamtrt.checkpoint import manifest as mf
from beamtrt.checkpoint.trtllm_files import STAMP_KEY, STAMP_RANK, TrtllmCheckpoint, rank_file
from beamtrt.cli_util import ArgumentParser, run_cli
from beamtrt.errors import CheckpointError


def check_checkpoint(path: Path) -> dict:
    """Validate one TensorRT-LLM checkpoint directory; returns its summary numbers."""
    ckpt = TrtllmCheckpoint(path)
    tp = ckpt.mapping.tp_size
    specs = ckpt.specs()
    extra = sorted(p.name for p in path.glob("rank*.safetensors") if p.name not in
                   {rank_file(path, r).name for r in range(tp)})
    if extra:
        raise CheckpointError(f"{path}: unexpected rank file {extra[0]} for tp_size {tp}")
    total = quantized = 0
    for r in range(tp):
        file = rank_file(path, r)
        handle = ckpt.open(r)
        names = set(handle.keys())
        missing, unexpected = sorted(set(specs) - names), sorted(names - set(specs))
        if missing:
            raise CheckpointError(f"{file}: missing {len(missing)} tensor(s), first {missing[0]!r}")
        if unexpected:
            raise CheckpointError(f"{file}: {len(unexpected)} unexpected tensor(s), first {unexpected[0]!r}")
        for name in specs:
            t = ckpt.get(r, name)  # checks shape, dtype and values
            total += t.numel() * t.element_size()
            quantized += t.dtype in (torch.uint8, torch.float8_e4m3fn) and name.endswith(".weight")
    return {"ranks": tp, "tensors_per_rank": len(specs), "bytes": total, "quantized_weights": quantized // tp,
            "architecture": ckpt.config.get("architecture"), "dtype": ckpt.config.get("dtype")}


AGREE = {  # part -> {what its config.json says: the manifest field it must equal}
    "target": {"architecture": "target.architecture", "precision": "precision", "kv_cache": "kv_cache",
               "mapping": "mapping"},
    "drafter": {"architecture": "drafter.architecture", "precision": "drafter_precision", "mapping": "mapping",
                "block_size": "drafter.train_block_size"},
}


def agree(root: Path, manifest: dict, files: bool = True) -> None:
    """The build's two config.json files say what its manifest says, every rank file's header names the build stage
    and rank that wrote it (where it was written with them), and every file but the weights and engines (configs,
    draft vocabulary, tokenizer, calibration, plugin library: small) has the sha256 it was built with. No weight is
    read: run.py and the Triton model check this at every start, the validator also hashes the weights (files=False:
    it has hashed every file already). One line naming the file that differs."""
    stamps = {}
    for part, fields in AGREE.items():
        ckpt = TrtllmCheckpoint(root / manifest[part]["dir"])
        key = mf.field(manifest, f"stages.{part}.key", None)
        for r in range(ckpt.mapping.tp_size):
            try:
                stamps[rank_file(ckpt.path, r), str(r), key] = ckpt.open(r).metadata
            except CheckpointError:  # missing or damaged: named by the rank that loads it (validate: by check_files)
                pass
        said = {"architecture": ckpt.config.get("architecture"), "precision": ckpt.precision,
                "kv_cache": ckpt.kv_cache, "mapping": ckpt.mapping.to_json()}
        if "block_size" in fields:
            said["block_size"] = ckpt.drafter_config().block_size
        for name, dotted in fields.items():
            want = mf.field(manifest, dotted, None)
            if want is not None and said[name] != want:  # None: an older manifest without the field
                shown = repr if type(said[name]) is not type(want) else str  # 16 and "16" would read the same
                raise CheckpointError(f"{ckpt.path / 'config.json'}: {name} {shown(said[name])} differs from the "
                                      f"manifest's {dotted} {shown(want)} (changed since the build: rebuild with "
                                      "build/build_engines.py)")
    for (file, rank, key), meta in stamps.items():
        if STAMP_KEY not in meta:  # written before the stamps (a stage reused since keeps its files as they were)
            continue
        if meta[STAMP_KEY] != key:
            raise CheckpointError(f"{file}: written by another build than {mf.MANIFEST}'s (copied from one?): "
                                  "rebuild with build/build_engines.py")
        if meta.get(STAMP_RANK) != rank:
            raise CheckpointError(f"{file}: holds rank {meta.get(STAMP_RANK)}'s weights, not rank {rank}'s "
                                  "(renamed or copied since the build: rebuild with build/build_engines.py)")
    if files:
        check_files(root, manifest, weights=False)


def check_files(root: Path, manifest: dict, weights: bool = True, bar=None) -> None:
    """Every file the manifest lists is there with its sha256 (weights=False: all but the rank files and engines);
    `bar`, a progress bar (cli_util.progress), advances by each file's bytes."""
    for rel, digest in manifest.get("files", {}).items():
        if not weights and rel.endswith((".safetensors", ".engine")):
            continue
        file = root / rel
        if not file.is_file():
            found = "a directory" if file.is_dir() else "missing"
            raise CheckpointError(f"{file}: listed in {mf.MANIFEST} but {found}")
        if mf.sha256_file(file) != digest:
            raise CheckpointError(f"{file}: sha256 differs from {mf.MANIFEST} (modified or corrupt: rebuild with "
                                  "build/build_engines.py)")
        if bar is not None:
            bar.update(file.stat().st_size)


def validate(root: str | Path, weights_hashed: bool = False, progress: bool = False) -> list[str]:
    """Validate a build output directory; returns the summary lines. Raises CheckpointError on the first problem.
    `weights_hashed`: the caller has just checked the rank files' and engines' sha256 (a rebuild whose every stage is
    up to date): read once, not twice, on a model of hundreds of GB. `progress`: a bar over the bytes hashed, on a
    terminal (hours on Beam)."""
    root = Path(root)
    manifest = mf.read_manifest(root)  # names a missing directory or one that is not a build
    bar = cli_util.progress(sum(p.stat().st_size for p in (root / rel for rel in manifest.get("files", {}))
                                if p.is_file()), "sha256", unit="B", scale=True) if progress else None
    try:
        check_files(root, manifest, weights=not weights_hashed, bar=bar)
    finally:
        if bar is not None:
            bar.close()
    listed = set(manifest.get("files", {})) | {mf.MANIFEST}
    unlisted = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                      and str(p.relative_to(root)) not in listed)
    if unlisted:
        raise CheckpointError(f"{root / unlisted[0]}: not listed in {mf.MANIFEST}")
    m = manifest["mapping"]
    agree(root, manifest, files=False)  # check_files above hashed them
    parts = {part: check_checkpoint(root / manifest[part]["dir"]) for part in ("target", "drafter")}
    kept = {part: "" if s["dtype"] in (None, "bfloat16") else f" ({s['dtype']} weights)"  # what is not quantized
            for part, s in parts.items()}                                                  # keeps the source's dtype
    lines = [f"{root}: {manifest['precision']} target{kept['target']}, {manifest['drafter_precision']} drafter"
             f"{kept['drafter']}, KV cache {manifest['kv_cache']}, tp {m['tp_size']} "
             f"(moe_tp {m['moe_tp_size']} × moe_ep {m['moe_ep_size']})"]
    for part, s in parts.items():
        lines.append(f"  {part:8s} {s['architecture']}: {s['ranks']} rank file(s) × {s['tensors_per_rank']} tensors, "
                     f"{s['bytes'] / 1e6:.1f} MB, {s['quantized_weights']} quantized weight tensors per rank: OK")
    for name, stage in manifest.get("stages", {}).items():  # what the build that made it did, not this command
        status = {"ran": f"done in {stage.get('seconds', 0):.1f} s", "reused": "reused from an earlier build"}
        why = f" ({stage['reason']})" if stage.get("reason") else ""
        lines.append(f"  stage {name:9s} {status.get(stage['status'], stage['status'])}{why}")
    lines.append(f"  {len(manifest.get('files', {}))} files, sha256 verified")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m beamtrt.checkpoint.validate",
                       description="Check a build_engines.py output directory (manifest, TensorRT-LLM "
                                   "checkpoints, every rank's tensors, sha256) and print a summary.")
    p.add_argument("dir", help="the build output directory (holds manifest.json, target/, drafter/)")
    args = p.parse_args(argv)
    return run_cli(lambda: print("\n".join(validate(args.dir, progress=True))))
