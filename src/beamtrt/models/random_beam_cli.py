"""Command line of scripts/make_random_beam.py."""

from __future__ import annotations

import math

import torch

from beamtrt.cli_util import ArgumentParser, check_room, check_seed, output_path, run_cli, size_text
from beamtrt.config import BeamConfig
from beamtrt.errors import BeamtrtError
from beamtrt.models import beam
from beamtrt.models.random_beam import memory_bytes, write_random_beam

# flag -> (BeamConfig field, default); defaults give a small model that still has every Beam feature
SIZE_FLAGS = {
    "--vocab-size": ("vocab_size", 1024),
    "--hidden-size": ("hidden_size", 256),
    "--layers": ("num_hidden_layers", 4),
    "--heads": ("num_attention_heads", 8),
    "--kv-heads": ("num_key_value_heads", 4),
    "--head-dim": ("head_dim", 32),
    "--intermediate-size": ("intermediate_size", 512),
    "--moe-intermediate-size": ("moe_intermediate_size", 128),
    "--experts": ("num_experts", 8),
    "--top-k": ("num_experts_per_tok", None),  # None: 2, or 0 with --experts 0
    "--shared-expert-size": ("shared_expert_intermediate_size", 0),
}
ZERO_MEANS = {"--head-dim": "hidden_size / heads", "--experts": "every layer dense", "--shared-expert-size": "none"}
# --max-shard-gb is at least 2 / MAX_SHARDS of the checkpoint, so at most MAX_SHARDS shard files are written (a shard
# and the next hold more than one limit together); published checkpoints have a few hundred (DeepSeek-V3, 671B: 163)
MAX_SHARDS = 1000
SHARD_GB = 2.0  # the default, never refused (a checkpoint past 1 TB then has more than MAX_SHARDS of them)


def largest_tensor(cfg: BeamConfig) -> tuple[str, int]:
    """The flags and sizes that give a config's largest tensor, and its element count: every weight is --hidden-size
    by one of these, or smaller (hf_tensor_specs), the MLP widths those of the layers it has."""
    moe = cfg.num_moe_layers
    rows = {f"--vocab-size {cfg.vocab_size:,}": cfg.vocab_size,
            f"--heads {cfg.num_attention_heads:,} × --head-dim {cfg.head_dim:,}": cfg.q_size}
    if moe < cfg.num_hidden_layers:
        rows[f"--intermediate-size {cfg.intermediate_size:,}"] = cfg.intermediate_size
    if moe:
        rows.update({f"--moe-intermediate-size {cfg.moe_intermediate_size:,}": cfg.moe_intermediate_size,
                     f"--experts {cfg.num_experts:,}": cfg.num_experts,
                     f"--shared-expert-size {cfg.shared_expert_intermediate_size:,}":
                         cfg.shared_expert_intermediate_size})
    sizes, n = max(rows.items(), key=lambda row: row[1])
    return f"{sizes} × --hidden-size {cfg.hidden_size:,}", n * cfg.hidden_size


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description="Write a random Beam-architecture Hugging Face checkpoint "
                       "(config.json + sharded safetensors), streamed tensor by tensor.")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    for flag, (field, default) in SIZE_FLAGS.items():
        zero = f"; 0 = {ZERO_MEANS[flag]}" if flag in ZERO_MEANS else ""
        said = "2; 0 with --experts 0" if default is None else "%(default)s"
        p.add_argument(flag, type=int, default=default, help=f"{field}{zero} (default: {said})")
    p.add_argument("--dense-layers", type=int, nargs="*", default=[0],
                   help="layers with one dense MLP instead of experts (mlp_only_layers); --dense-layers alone: none "
                        "(default: 0, the first layer)")
    p.add_argument("--no-qk-norm", action="store_true", help="drop the per-head q/k RMSNorm")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="storage dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--max-shard-gb", type=float, default=SHARD_GB,
                   help=f"shard size limit in GiB, at least 1/{MAX_SHARDS // 2} of the checkpoint's size "
                        f"({MAX_SHARDS:,} shard files at most) or the default (default: %(default)s)")
    args = p.parse_args(argv)

    def run() -> None:
        if args.top_k is None:
            args.top_k = 2 if args.experts else 0
        elif not args.experts and args.top_k:  # BeamConfig reads such a config, as transformers does; asked: a slip
            raise ValueError(f"--top-k {args.top_k} with --experts 0: a model without experts takes --top-k 0")
        if len(set(args.dense_layers)) < len(args.dense_layers):
            raise ValueError(f"--dense-layers {' '.join(map(str, args.dense_layers))}: names a layer more than once")
        sizes = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in SIZE_FLAGS.items()}
        cfg = BeamConfig(**sizes, mlp_only_layers=tuple(args.dense_layers), use_qk_norm=not args.no_qk_norm)
        if not 0 < args.max_shard_gb * 1024**3 < math.inf:  # in bytes: 1e300 GB overflowed their count
            raise ValueError(f"--max-shard-gb must be a finite number > 0, got {args.max_shard_gb}")
        check_seed(args.seed)
        out = output_path(args.out, "--out", directory=True)
        dtype, max_shard_bytes = getattr(torch, args.dtype), int(args.max_shard_gb * 1024**3)
        total = beam.checkpoint_bytes(cfg, dtype.itemsize)
        check_room(total, out, "--out with these sizes")
        least = min(2 * total / MAX_SHARDS / 1024**3, SHARD_GB)
        if args.max_shard_gb < least:
            step = 10.0 ** (math.floor(math.log10(least)) - 1)  # least, rounded up to 2 significant digits
            raise ValueError(f"--max-shard-gb {args.max_shard_gb:g} is under 1/{MAX_SHARDS // 2} of this "
                             f"{total / 1e9:.4g} GB checkpoint, the size that keeps it to {MAX_SHARDS:,} shard files "
                             "at most (a tensor larger than a shard is a file of its own): give at least "
                             f"{math.ceil(least / step) * step:g}")
        flags, largest = largest_tensor(cfg)  # Linux grants more than it has: the out-of-memory killer ends it
        need, free = memory_bytes(largest, dtype, max_shard_bytes, total), beam.free_memory(torch.device("cpu"))
        if free is not None and need > free:
            raise BeamtrtError(f"the largest tensor ({flags}) needs {size_text(need)} of memory to be made and written "
                               f"(in float32, then {args.dtype}, beside the shard being gathered: up to --max-shard-gb "
                               f"{args.max_shard_gb:g}, or one larger tensor alone); this host has {size_text(free)} "
                               "available")
        out = write_random_beam(args.out, cfg, args.seed, dtype, max_shard_bytes, progress=True)
        print(f"random Beam checkpoint: {out}")

    return run_cli(run)
