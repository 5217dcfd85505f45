"""Command line of scripts/export_triton.py: a build output -> a validated Triton model repository."""

from __future__ import annotations

import argparse
from pathlib import Path

from beamtrt.cli_util import ArgumentParser, run_cli
from beamtrt.runtime.loader import BACKENDS, DTYPES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from beamtrt.triton.export import MAX_SEQ_LEN, MAX_SLOTS

    p = ArgumentParser(
        description="Write a build_engines.py output as a Triton Inference Server model repository: preprocessing "
                    "(chat template + tokenizer), beam_dflash2 (decoupled Python model running the beamtrt runtime, "
                    "leader mode over the build's TP ranks), postprocessing (detokenizer) and the ensemble chaining "
                    "them; then validate it. Launch it with scripts/launch_triton.sh.")
    p.add_argument("--engine-dir", type=Path, required=True, help="the build output (engines/<precision>-tp<N>)")
    p.add_argument("--out", type=Path, required=True, help="the model repository to write")
    p.add_argument("--copy-engines", action="store_true",
                   help="copy the build into the repository (beam_dflash2/1/engine) instead of referencing it by its "
                        "absolute path")
    p.add_argument("--force", action="store_true",
                   help="replace a model repository an earlier export wrote at --out (the whole folder; a folder of "
                        "anything else is refused even so)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="runtime backend of beam_dflash2: trt runs the build's engines, torch its checkpoints, auto "
                        "picks trt where the build has engines and the host can run them (default: %(default)s)")
    p.add_argument("--block-size", type=int, help="tokens per verification block (default: the build's)")
    p.add_argument("--draft-threshold", type=float, default=0.0, metavar="P",
                   help="verify only the leading drafts whose running product of drafter confidences is >= P, in "
                        "[0, 1] (runtime/run.py's flag); 0 verifies whole blocks (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES),
                   help="compute dtype of the torch backend; refused with --backend trt, whose engines run as built "
                        "(default: bfloat16)")
    p.add_argument("--device",
                   help="torch device: cpu, cuda, cuda:N, or auto = cuda where available; a TP build served on the "
                        "torch backend runs its ranks on cpu (auto picks it, cuda is refused); refused with --backend "
                        "trt (default: auto)")
    p.add_argument("--max-slots", type=int,
                   help="requests decoded at once; more wait in beam_dflash2's queue; served on the build's engines, "
                        f"at most their --max-batch-size (default: {MAX_SLOTS}, or that where lower)")
    p.add_argument("--max-seq-len", type=int,
                   help="the most tokens one request may need: prompt + max_tokens + block size - 2, at most the "
                        "target's context and the build's --max-seq-len "
                        f"(default: {MAX_SEQ_LEN}, or the lower of those)")
    p.add_argument("--seed", type=int, default=0, help="a request sent without random_seed samples from a stream "
                   "seeded by this and its arrival number, in [0, 2**63) (default: %(default)s)")
    p.add_argument("--raw-prompts", action="store_true",
                   help="send text_input to the model as raw text instead of a user message in the chat template")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: _run(args))


def _run(args: argparse.Namespace) -> None:
    from beamtrt.triton.export import ExportConfig, export

    cfg = ExportConfig(args.engine_dir, args.out, args.copy_engines, args.force, args.backend, args.block_size,
                       args.dtype, args.device, args.max_slots, args.max_seq_len, args.seed, not args.raw_prompts,
                       args.draft_threshold)
    print("\n".join(export(cfg)))
