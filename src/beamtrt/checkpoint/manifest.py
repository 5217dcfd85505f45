"""manifest.json of a build output directory: what was built, from what, by which stages, and every file's sha256."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from beamtrt.checkpoint.hf import read_json, write_json
from beamtrt.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_CHUNK = 16 * 1024 * 1024


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_inputs(*parts: object, files: list[Path] = ()) -> str:
    """One sha256 over JSON-able settings and the contents of `files` (in the given order)."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for file in files:
        h.update(file.name.encode() + b"\0" + sha256_file(file).encode())
    return h.hexdigest()


def model_files(path: Path) -> list[Path]:
    """The files that define a Hugging Face checkpoint's function: config.json and its safetensors (+ index, + a
    drafter's draft vocabulary)."""
    from beamtrt.models.dflash2 import DRAFT_VOCAB_FILE

    files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors"
                   or p.name in ("model.safetensors.index.json", DRAFT_VOCAB_FILE))
    return [path / "config.json"] + files


def file_hashes(root: Path, files: list[Path]) -> dict[str, str]:
    return {str(f.relative_to(root)): sha256_file(f) for f in files}


REQUIRED = {  # what the loaders, the validator and the Triton export read from a manifest
    "mapping": ("tp_size", "moe_tp_size", "moe_ep_size"),
    "target": ("dir", "architecture", "source"),
    "drafter": ("dir", "block_size"),
    "stages": (),
    "files": (),
}
REQUIRED_VALUES = ("precision", "drafter_precision", "kv_cache")


def read_manifest(root: Path) -> dict:
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory (expected a build/build_engines.py output)")
    if not (root / MANIFEST).is_file():
        raise CheckpointError(f"{root} is not a build/build_engines.py output (no {MANIFEST})")
    manifest = read_json(root / MANIFEST, "build manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{root / MANIFEST}: format_version {manifest.get('format_version')!r} is not "
                              f"{FORMAT_VERSION}; rebuild with this version of build_engines.py")
    lacking = [key for key in REQUIRED_VALUES if key not in manifest]
    for section, keys in REQUIRED.items():
        value = manifest.get(section)
        lacking += [f"{section}.{k}" for k in keys if k not in value] if isinstance(value, dict) else [section]
    if lacking:
        raise CheckpointError(f"{root / MANIFEST} lacks {lacking[0]!r}: rebuild with build/build_engines.py")
    return manifest


def write_manifest(root: Path, manifest: dict) -> None:
    write_json(Path(root) / MANIFEST, {"format_version": FORMAT_VERSION, **manifest})


def stage_outputs_intact(root: Path, stage: dict) -> bool:
    """Whether every file a stage recorded still exists with its recorded sha256."""
    files = stage.get("files") or {}
    return all((root / name).is_file() and sha256_file(root / name) == digest for name, digest in files.items())
