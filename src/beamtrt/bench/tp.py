"""Tensor-parallel decode benchmark: runtime/run.py on 1, 2 and 4 MPI ranks × concurrency, with and without
speculation, on builds of one model (JSON: decode tokens/s, acceptance length, time per step split)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from beamtrt.cli_util import (ArgumentParser, child_error, output_path, outside_inputs, progress, run_child, run_cli,
                              say, work_dir)
from beamtrt.errors import BeamtrtError

ROOT = Path(__file__).resolve().parents[3]


def build(precision: str, tp: int, work: Path, model: str | None, drafter: str | None) -> Path:
    out = work / f"{precision}-tp{tp}"
    cmd = [sys.executable, str(ROOT / "build" / "build_engines.py"), "--precision", precision, "--tp", str(tp),
           "--out", str(out), "--quiet", "--force"]  # --work is this benchmark's: a build of other inputs is replaced
    cmd += [f"--{flag}={path}" for flag, path in (("model", model), ("drafter", drafter)) if path]
    proc = run_child(cmd, cwd=ROOT)  # Ctrl-C waits for the build to remove its temporary folder
    if proc.returncode != 0:
        raise BeamtrtError(f"build failed: {child_error(proc.stderr, proc.returncode)}")
    return out


def decode(engine: Path, tp: int, prompts: Path, concurrency: int, spec: bool, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "out.json"
        cmd = [sys.executable, str(ROOT / "runtime" / "run.py"), "--engine-dir", str(engine), "--prompts",
               str(prompts), "--concurrency", str(concurrency), "--max-new-tokens", str(tokens), "--quiet",
               "--json", str(report)] + ([] if spec else ["--no-spec"])
        if tp > 1:  # .venv's mpirun, else the host's (a TensorRT-LLM host's .venv has none), as root and on few cores
            cmd = [str(ROOT / "scripts" / "mpirun"), "-n", str(tp)] + cmd
        env = {**os.environ, "OMP_NUM_THREADS": "1" if tp > 1 else "2"}  # the host's 2 cores either way
        proc = run_child(cmd, cwd=ROOT, env=env, start_new_session=tp > 1)  # a signal reaches the whole job
        if proc.returncode != 0:
            reason = child_error(proc.stderr, proc.returncode)
            if "report above" in reason:  # scripts/mpirun's line for a rank killed or crashed: show the report it means
                from tqdm import tqdm

                notices = [line for line in proc.stderr.splitlines() if not line.startswith("error:")]
                tqdm.write("\n".join(notices).strip("\n"), file=sys.stderr)
            raise BeamtrtError(f"run failed (tp {tp}, c {concurrency}): {reason}")
        s = json.loads(report.read_text())["summary"]
    tau = s["acceptance_length"]  # None: no verification step (a request that ended at its first token)
    # steps as run.py --json names them; the rate as measured: the speedup is their ratio, rounded by whoever shows it
    return {"decode_tokens_per_s": decode_rate(s), "acceptance_length": tau, "steps": s["steps"],
            "decoder_steps": s["decoder_steps"], "step_s": s["step_s"]}


def decode_rate(summary: dict) -> float | None:
    """A run.py --json summary -> tokens/s after each request's first (which comes from its prefill), over the decode
    steps' time (the parts of its split; the prefill out); None where no request got past its first token."""
    seconds = sum(summary[f"{part}_s"] for part in summary["step_s"])
    return (summary["tokens"] - summary["requests"]) / seconds if seconds else None


def check_target(model: str | None, tps: list[int], max_new_tokens: int) -> None:
    """What the builds and runs would refuse minutes in (after the earlier --tp's were built and measured), from the
    target's config.json: a --tp that does not split it, a --max-new-tokens past its context. beam-mini is made here
    where it is not yet (the first build would make it)."""
    from beamtrt.checkpoint import trtllm
    from beamtrt.config import BeamConfig
    from beamtrt.errors import ConfigError
    from beamtrt.models.beam_mini import ensure_beam_mini

    cfg = BeamConfig.from_file(model or ensure_beam_mini())  # None: beam-mini
    for tp in tps:
        try:
            trtllm.target_units(cfg, trtllm.Mapping(tp, 1))
        except ConfigError as e:
            raise BeamtrtError(f"--tp {tp}: {e}") from None
    if max_new_tokens > cfg.max_position_embeddings:
        raise BeamtrtError(f"--max-new-tokens {max_new_tokens} is more than the target's context of "
                           f"{cfg.max_position_embeddings} tokens")


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description="Decode tokens/s with and without speculation at TP 1/2/4 and several "
                                   "concurrencies (each TP a separate build of the same model; JSON).")
    p.add_argument("--model", help="Hugging Face target (default: beam-mini)")
    p.add_argument("--drafter", help="its DFlash2 drafter (default: as build_engines.py picks it: beam-mini's, for "
                                     "beam-mini)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "nvfp4"),
                   help="build precision (default: %(default)s)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="rank counts (default: %(default)s)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32],
                   help="concurrent requests (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="tokens per request, at least 2 (decode speed is measured after the first) "
                        "(default: %(default)s)")
    p.add_argument("--work", type=Path, default=ROOT / "bench" / "tp",
                   help="folder for this benchmark's builds, one per --tp (<precision>-tp<N>), and its prompt "
                        "files; a build already there from other inputs or settings is replaced, so a folder holding "
                        "anything else is refused (default: bench/tp)")
    p.add_argument("--json", type=Path, help="write the results to this file")
    args = p.parse_args(argv)

    def body() -> None:
        from beamtrt.models.beam_mini import DEFAULT_DIR, RANDOM_DRAFTER, TRAINED_DRAFTER
        from beamtrt.quant.calibrate import default_prompts_path

        if min(args.tp) < 1 or min(args.concurrency) < 1:
            raise BeamtrtError("--tp and --concurrency must be >= 1")
        if args.max_new_tokens < 2:
            raise BeamtrtError(f"--max-new-tokens must be >= 2 (the first token comes from the prefill; decode speed "
                               f"is measured on the rest), got {args.max_new_tokens}")
        # the commands it runs start in the repository: paths as the user gave them would be read from there
        args.work = args.work.absolute()
        args.model, args.drafter = (str(Path(x).absolute()) if x else x for x in (args.model, args.drafter))
        if args.json:
            output_path(args.json, "--json")
            drafters = [args.drafter] if args.drafter else [TRAINED_DRAFTER, RANDOM_DRAFTER]  # build_engines' default
            outside_inputs(args.json, "--json", [("the target", args.model or DEFAULT_DIR),
                                                 *(("the drafter", d) for d in drafters),
                                                 ("the prompts", default_prompts_path()),
                                                 ("--work", args.work)])  # whose contents are replaced
        work_dir(args.work, "bench_tp.py", make=False)  # before check_target, which may take minutes making beam-mini
        check_target(args.model, args.tp, args.max_new_tokens)
        work_dir(args.work, "bench_tp.py")
        results = {"model": args.model or str(DEFAULT_DIR), "drafter": args.drafter,  # None: build_engines' default
                   "precision": args.precision, "max_new_tokens": args.max_new_tokens, "runs": []}
        bar = progress(len(args.tp) * (1 + 2 * len(args.concurrency)), "bench_tp", unit="command")
        for tp in args.tp:
            bar.set_postfix_str(f"tp {tp}: build")
            engine = build(args.precision, tp, args.work, args.model, args.drafter)
            for c in args.concurrency:
                prompts = args.work / f"prompts-{c}.jsonl"
                lines = default_prompts_path().read_text().splitlines()
                prompts.write_text("\n".join((lines * (c // len(lines) + 1))[:c]) + "\n")
                row = {"tp": tp, "concurrency": c}
                for spec in (False, True):
                    bar.update()
                    bar.set_postfix_str(f"tp {tp}, c {c}: {'spec' if spec else 'plain'}")
                    row["spec" if spec else "plain"] = decode(engine, tp, prompts, c, spec, args.max_new_tokens)
                rates = row["spec"]["decode_tokens_per_s"], row["plain"]["decode_tokens_per_s"]
                row["speedup"] = rates[0] / rates[1] if None not in rates else None
                results["runs"].append(row)
                say(bar, json.dumps(row), sys.stdout)
            bar.update()
        bar.close()
        if args.json:
            from beamtrt.checkpoint.hf import write_json  # imports torch, which this launcher does not need

            write_json(args.json, results)

    return run_cli(body)
