"""Command line of scripts/make_random_beam.py."""

from __future__ import annotations

import dataclasses
import math

import torch

from beamtrt.cli_util import ArgumentParser, check_seed, free_bytes, output_path, run_cli
from beamtrt.config import BeamConfig
from beamtrt.models.random_beam import write_random_beam

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
    "--top-k": ("num_experts_per_tok", 2),
    "--shared-expert-size": ("shared_expert_intermediate_size", 0),
}


def checkpoint_bytes(cfg: BeamConfig, element_size: int) -> int:
    """The weight bytes of a checkpoint of this config, without listing its tensors (a layer count in the millions
    would not fit in memory as a list): the embedding and head, plus each layer's, measured on 1- and 2-layer
    configs of the same shape."""
    from beamtrt.models.beam import hf_tensor_specs

    def size(layers: int, dense: bool) -> int:
        c = dataclasses.replace(cfg, num_hidden_layers=layers, mlp_only_layers=tuple(range(layers)) if dense else ())
        return sum(math.prod(shape) for shape, _, _ in hf_tensor_specs(c).values())

    moe_layer, dense_layer = size(2, False) - size(1, False), size(2, True) - size(1, True)
    base = size(1, False) - moe_layer
    n_dense = len({i for i in cfg.mlp_only_layers if i < cfg.num_hidden_layers})
    return element_size * (base + n_dense * dense_layer + (cfg.num_hidden_layers - n_dense) * moe_layer)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description="Write a random Beam-architecture Hugging Face checkpoint "
                       "(config.json + sharded safetensors), streamed tensor by tensor.")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    for flag, (field, default) in SIZE_FLAGS.items():
        p.add_argument(flag, type=int, default=default, help=f"{field} (default: %(default)s)")
    p.add_argument("--dense-layers", type=int, nargs="*", default=[0],
                   help="layers with one dense MLP instead of experts (mlp_only_layers); --dense-layers alone: none "
                        "(default: 0, the first layer)")
    p.add_argument("--no-qk-norm", action="store_true", help="drop the per-head q/k RMSNorm")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="storage dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="shard size limit in GiB (default: %(default)s)")
    args = p.parse_args(argv)

    def run() -> None:
        sizes = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in SIZE_FLAGS.items()}
        cfg = BeamConfig(**sizes, mlp_only_layers=tuple(args.dense_layers), use_qk_norm=not args.no_qk_norm)
        if not 0 < args.max_shard_gb < math.inf:
            raise ValueError(f"--max-shard-gb must be a finite number > 0, got {args.max_shard_gb}")
        check_seed(args.seed)
        out = output_path(args.out, "--out", directory=True)
        need, free = checkpoint_bytes(cfg, getattr(torch, args.dtype).itemsize), free_bytes(out.absolute().parent)
        if need > free:
            raise ValueError(f"these sizes make a {need / 1e9:.4g} GB checkpoint; {out.absolute().parent} has "
                             f"{free / 1e9:.4g} GB free")
        out = write_random_beam(args.out, cfg, args.seed, getattr(torch, args.dtype),
                                int(args.max_shard_gb * 1024**3), progress=True)
        print(f"random Beam checkpoint: {out}")

    return run_cli(run)
