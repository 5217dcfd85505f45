"""Random Beam-architecture checkpoints of any size, streamed tensor by tensor (for tests and memory benchmarks)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from beamtrt.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, save_checkpoint
from beamtrt.config import BeamConfig
from beamtrt.errors import CheckpointError
from beamtrt.models.beam import hf_tensor_specs


def random_tensors(cfg: BeamConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   std: float = 0.05) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of a Beam checkpoint: norms near 1, the rest N(0, std); one tensor in memory at a time."""
    gen = torch.Generator().manual_seed(seed)
    for name, (shape, _, _) in hf_tensor_specs(cfg).items():
        yield name, _random(shape, gen, std, name.endswith("norm.weight"), dtype)


def _random(shape: tuple[int, ...], gen: torch.Generator, std: float, norm: bool, dtype: torch.dtype) -> torch.Tensor:
    """N(0, std), or 1 + N(0, std) for a `norm`, in `dtype`: made in one float32 copy (in place), dropped on return,
    not held while the next tensor is made."""
    t = torch.randn(shape, generator=gen).mul_(std)
    return (t.add_(1.0) if norm else t).to(dtype)


def memory_bytes(largest: int, dtype: torch.dtype, max_shard_bytes: int, total: int) -> int:
    """The most memory write_random_beam holds for a checkpoint of `total` bytes whose largest tensor has `largest`
    elements: that tensor made in float32 and converted to `dtype`, beside the shard being gathered (up to
    `max_shard_bytes`, or one larger tensor alone)."""
    item = dtype.itemsize
    return (4 + item) * largest + max(min(max_shard_bytes, total), item * largest)


def write_random_beam(out: str | Path, cfg: BeamConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = False) -> Path:
    """Write config.json + sharded safetensors to `out` atomically (temp dir, then rename)."""
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists: choose another output directory or delete it")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:  # a generator: its bar starts once out's staging is held
        made = random_tensors(cfg, seed, dtype)
        if progress:
            from tqdm import tqdm

            made = tqdm(made, total=len(hf_tensor_specs(cfg)), desc="random Beam", unit="tensor")
        yield from made

    return save_checkpoint(out, tensors(), cfg, "choose another output directory or delete it", max_shard_bytes)
