"""Command line of build/build_engines.py (the calibrate / quantize / shard / engine pipeline)."""

from __future__ import annotations

import argparse
from pathlib import Path

from beamtrt.cli_util import ArgumentParser, output_path, run_cli

ENGINES = Path(__file__).resolve().parents[3] / "engines"
LAST_BUILD = ENGINES / ".last-build"  # the last successful build into engines/ (runtime/run.py's default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description="Calibrate, quantize (NVFP4 / FP8 / BF16) and shard a Beam target and its DFlash2 drafter into "
                    "TensorRT-LLM checkpoints, then build engines where TensorRT-LLM and a GPU exist. Without "
                    "--model / --drafter it uses beam-mini and its drafter, created on first use.")
    p.add_argument("--precision", choices=("nvfp4", "fp8", "bf16"), required=True,
                   help="target weight/activation precision: nvfp4 (E2M1 + E4M3 block scales), fp8 (E4M3 per-tensor) "
                        "or bf16 (no quantization: weights keep the checkpoint's dtype, bf16 for beam-mini and "
                        "Beam; an fp32 or fp16 checkpoint stays fp32 or fp16, as the quantized builds' unquantized "
                        "parts do)")
    p.add_argument("--model", type=Path, help="Hugging Face target checkpoint directory (default: checkpoints/beam-mini)")
    p.add_argument("--drafter", type=Path,
                   help="DFlash2 drafter checkpoint directory (default: beam-mini's drafter, the trained one if "
                        "present, else a deterministic random one)")
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel ranks (default: %(default)s)")
    p.add_argument("--moe-ep", type=int, default=1,
                   help="expert-parallel ways inside the MoE; it must divide --tp, the rest splits each expert "
                        "(moe_tp = tp / moe_ep) (default: %(default)s)")
    p.add_argument("--kv-cache", choices=("auto", "fp8"), default="auto",
                   help="KV-cache precision: auto = the model dtype, fp8 = calibrated E4M3 (default: %(default)s)")
    p.add_argument("--drafter-precision", choices=("bf16", "fp8"), default="bf16",
                   help="drafter precision: bf16 keeps its checkpoint's dtype; fp8 quantizes its decoder layers' "
                        "GEMMs (calibrated on the target's features for the calibration prompts); its fusion fc, "
                        "norms, convs and selector stay high precision (default: %(default)s)")
    p.add_argument("--calib-prompts", type=Path,
                   help='calibration prompts, JSONL with one {"prompt": "..."} or {"messages": [...]} per line, '
                        "chat-formatted through the model's template, each cut to its first 256 tokens (default: the "
                        "packaged general-purpose set, not taken from any benchmark)")
    p.add_argument("--calib-samples", type=int, default=32,
                   help="calibration sequences, at most 4096 (prompts are cycled if fewer) (default: %(default)s)")
    p.add_argument("--out", type=Path, help="output directory (default: engines/<precision>-tp<N>, which "
                   "runtime/run.py then runs by default)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output built from other inputs or settings, or one that no longer "
                        "validates: the whole folder is deleted (stages whose inputs are unchanged are still reused); "
                        "a folder that is not a build output is refused even so")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="engines: most requests decoded at once (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int,
                   help="engines: most cache positions per request: its prompt, its output and block - 2 more for "
                        "the last verify; at most the target's max_position_embeddings (default: that, 8192 "
                        "for beam-mini)")
    p.add_argument("--max-num-tokens", type=int, default=8192,
                   help="engines: most tokens in one target step, all requests together (longer prompts are "
                        "prefilled in chunks of this size) (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=8,
                   help="engines: tokens verified per step (anchor + block-1 drafts); runtime/run.py must use the "
                        "same --block-size with the trt backend (default: %(default)s)")
    p.add_argument("--tensorrt-root", default="",
                   help="engines: TensorRT installation whose include/ has NvInfer.h, for the plugin library "
                        "(default: $TRT_ROOT, else /usr/local/tensorrt)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: _run(args))


def _built_from(build: Path, part: str = "target") -> str:
    """What to pass instead of a build given as --model (`part` target) or --drafter (drafter): the checkpoint its
    manifest records as that part's source, or where to look for it when the manifest cannot be read or records none."""
    from beamtrt.checkpoint.hf import read_json
    from beamtrt.checkpoint.manifest import MANIFEST, field
    from beamtrt.errors import CheckpointError

    try:
        source = field(read_json(build / MANIFEST, "build manifest"), f"{part}.source", None)
    except CheckpointError:
        source = None
    flag, what = ("--model", "Hugging Face") if part == "target" else ("--drafter", "drafter")
    if isinstance(source, str) and source and Path(source).is_dir():  # a relative one: from where the build ran
        return f"{flag} {source}, the {what} checkpoint it was built from"
    return f"the {what} checkpoint it was built from (its manifest.json's {part}.source)"


def _run(args: argparse.Namespace) -> None:
    from beamtrt.build.pipeline import build, log
    from beamtrt.checkpoint.manifest import read_manifest
    from beamtrt.config import BuildConfig, DrafterConfig, EngineSettings
    from beamtrt.prompts import TOKENIZER_FILES, has_tokenizer

    out = Path(args.out) if args.out else ENGINES / f"{args.precision}-tp{args.tp}"
    output_path(out, "--out", directory=True)  # before beam-mini or calibration, not after
    from beamtrt.runtime.loader import not_a_build

    if args.drafter is not None:  # likewise a --drafter that is not a drafter checkpoint
        not_a_build(Path(args.drafter), lambda build: _built_from(build, "drafter"), "--drafter")
        DrafterConfig.from_file(Path(args.drafter) / "config.json")
    model = args.model
    if model is None:
        from beamtrt.models.beam_mini import ensure_beam_mini
        model = ensure_beam_mini()
    else:
        not_a_build(model, _built_from)
    drafter = args.drafter
    if drafter is None:  # beam-mini's, said at once where it does not fit --model (the target's config is read here)
        from beamtrt.config import BeamConfig
        from beamtrt.models.beam_mini import default_drafter_for
        drafter = default_drafter_for(BeamConfig.from_file(Path(model) / "config.json"))
    bc = BuildConfig(model=Path(model), drafter=Path(drafter), out=out, precision=args.precision, tp=args.tp,
                     moe_ep=args.moe_ep, kv_cache=args.kv_cache, calib_prompts=args.calib_prompts,
                     calib_samples=args.calib_samples, drafter_precision=args.drafter_precision, force=args.force,
                     engine=EngineSettings(args.max_batch_size, args.max_seq_len, args.max_num_tokens, args.block_size,
                                           args.tensorrt_root))
    if bc.calib_prompts and not bc.needs_calibration:
        log("warning: --calib-prompts is not used: a bf16 build with a bf16 drafter and no FP8 KV cache needs no "
            "calibration")
    print("\n".join(build(bc, progress=not args.quiet)))
    if not has_tokenizer(bc.model):  # a conversion benchmark's random model has none; decoding and Triton need one
        log(f"warning: {bc.model} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): the build is complete, "
            "but runtime/run.py and the Triton export need them to encode prompts")
        if bc.calib_prompts and bc.needs_calibration:
            log("warning: --calib-prompts was not used: without a tokenizer, calibration ran on random token ids")
    if args.out is None:  # runtime/run.py runs the last default-location build unless told otherwise
        from beamtrt.checkpoint.hf import write_text
        write_text(LAST_BUILD, str(bc.out.resolve()) + "\n")
    stage = read_manifest(bc.out)["stages"]["engines"]
    if stage["status"] == "skipped":
        log(f"engines: skipped ({stage['reason']}); the TensorRT-LLM checkpoints are complete in {bc.out}; to build "
            "engines, run this same command with --force on a GPU host with TensorRT-LLM 1.2 (the checkpoints are "
            "reused where their inputs are unchanged)")
