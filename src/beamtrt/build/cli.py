"""Command line of build/build_engines.py (the convert/quantize/shard/engine pipeline)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        description="Convert, quantize (NVFP4 / FP8 / BF16) and shard a Beam checkpoint and its DFlash2 drafter "
                    "for TensorRT-LLM, and build the engines where TensorRT-LLM and a GPU exist.").parse_args(argv)
    print("error: the build pipeline is not implemented yet in this checkout", file=sys.stderr)
    return 2
