"""manifest.json of a build output directory: what was built, from what, by which stages, and every file's sha256."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from beamtrt.checkpoint.hf import read_json, require_dir, write_json
from beamtrt.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# everything a build writes at its top level (its engines and plugin library lie in target/, drafter/, plugins/)
BUILD_ENTRIES = frozenset({MANIFEST, "calibration.json", "target", "drafter", "tokenizer", "plugins"})
_CHUNK = 16 * 1024 * 1024


def looks_built(folder: Path) -> bool:
    """Whether `folder` is a build_engines.py output: its manifest.json names a format_version (any version's, beside
    whatever was added since), or, unreadable (damaged), lies beside nothing a build does not write. Another
    program's folder with a manifest.json of its own (a web app, a model zoo) is neither: never replaced, nor taken
    for a build."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return False
    try:
        written = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError):  # not JSON, or not UTF-8 (a ValueError too)
        written = None
    if isinstance(written, dict) and "format_version" in written:
        return True
    return all(p.name in BUILD_ENTRIES for p in folder.iterdir())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_inputs(*parts: object, files: list[Path] = (), digest: Callable[[Path], str] = sha256_file) -> str:
    """One sha256 over JSON-able settings and the contents of `files` (in the given order), each file's as `digest`
    gives it (a cache of sha256_file: a build keys several stages on the same files)."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    for file in files:
        h.update(file.name.encode() + b"\0" + digest(file).encode())
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


NULL = type(None)
REQUIRED = {  # field -> JSON type: what the loaders, the validator and the Triton export read from a manifest
    "precision": str, "drafter_precision": str, "kv_cache": str,
    "mapping": dict, "mapping.tp_size": int, "mapping.moe_tp_size": int, "mapping.moe_ep_size": int,
    "target": dict, "target.dir": str, "target.architecture": str, "target.source": str,
    "drafter": dict, "drafter.dir": str, "drafter.block_size": int,
    "stages": dict, "files": dict,
}
OPTIONAL = {  # checked where present
    "target.tokenizer": (str, NULL), "engines": (dict, NULL), "engines.built": bool, "engines.settings": dict,
    "engines.target": (str, NULL), "engines.drafter": (str, NULL), "engines.plugin_library": (str, NULL),
}
STAGE = {"status": str, "key": (str, NULL), "reason": (str, NULL), "files": (dict, NULL),  # every stage's fields
         "seconds": (int, float, NULL)}
_MISSING = object()
_REBUILD = "rebuild with build/build_engines.py (--force to replace this output)"  # a manifest this version cannot read


def field(manifest: dict, dotted: str, default: object = _MISSING) -> object:
    """manifest["a"]["b"] for "a.b"; `default` where any part is missing."""
    value = manifest
    for key in dotted.split("."):
        value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
    return default if value is _MISSING else value


def _fits(value: object, kind) -> bool:
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is int)  # JSON true is not a size


def read_manifest(root: Path) -> dict:
    """A build output's manifest, checked: every field the readers use present and of its JSON type."""
    root = require_dir(root, "a build/build_engines.py output directory")
    if not (root / MANIFEST).is_file():
        raise CheckpointError(f"{root} is not a build/build_engines.py output (no {MANIFEST})")
    try:
        manifest = read_json(root / MANIFEST, "build manifest")
    except CheckpointError as e:  # not JSON, not an object, unreadable
        raise CheckpointError(f"{e}: {_REBUILD}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{root / MANIFEST}: format_version {manifest.get('format_version')!r} is not this "
                              f"version's {FORMAT_VERSION}: {_REBUILD}")
    fields = [(name, field(manifest, name), kind, True) for name, kind in REQUIRED.items()]
    fields += [(name, field(manifest, name), kind, False) for name, kind in OPTIONAL.items()]
    for stage, record in manifest.get("stages", {}).items() if isinstance(manifest.get("stages"), dict) else ():
        fields.append((f"stages.{stage}", record, dict, True))
        fields += [(f"stages.{stage}.{k}", field(record, k), kind, k == "status") for k, kind in STAGE.items()]
    for name, value, kind, required in fields:
        if value is _MISSING and required:
            raise CheckpointError(f"{root / MANIFEST} lacks {name!r}: {_REBUILD}")
        if value is not _MISSING and not _fits(value, kind):
            raise CheckpointError(f"{root / MANIFEST}: {name!r} is {json.dumps(value)[:40]}, not the type its "
                                  f"readers expect: {_REBUILD}")
    return manifest


def write_manifest(root: Path, manifest: dict) -> None:
    write_json(Path(root) / MANIFEST, {"format_version": FORMAT_VERSION, **manifest})


def stage_outputs_intact(root: Path, stage: dict) -> bool:
    """Whether every file a stage recorded still exists with its recorded sha256."""
    files = stage.get("files") or {}
    return all((root / name).is_file() and sha256_file(root / name) == digest for name, digest in files.items())
