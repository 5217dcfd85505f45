"""Conversion benchmark: build_engines.py on a generated random Beam checkpoint of a few GB, per precision:
source MB/s of the conversion stage and end to end, and the peak RSS of the build process (JSON)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from beamtrt.checkpoint.hf import write_json
from beamtrt.cli_util import (ArgumentParser, child_error, ending_with_us, free_bytes, output_path, outside_inputs,
                              run_cli, work_dir)
from beamtrt.errors import BeamtrtError

ROOT = Path(__file__).resolve().parents[3]


def source_config(size_gb: float):
    """A Beam-architecture config of about size_gb GB in bf16: 32 experts of 1024 × 1024 per layer (≈ 201 MB)."""
    from beamtrt.config import BeamConfig

    layers = max(2, round((size_gb * 1e9 - 2 * 32768 * 1024 * 2) / (32 * 3 * 1024 * 1024 * 2 + 2.6e6 * 2)))
    return BeamConfig(vocab_size=32768, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=4, head_dim=64, intermediate_size=2048, moe_intermediate_size=1024,
                      num_experts=32, num_experts_per_tok=4, mlp_only_layers=(0,))


def drafter_config(cfg):
    """The sources' one-layer drafter for target config `cfg`, on DFlash's two default taps ((1, L - 2) named layer 1
    twice at L = 3: every --size-gb of 3 layers failed)."""
    from beamtrt.config import DrafterConfig, default_target_layer_ids

    taps = default_target_layer_ids(cfg.num_hidden_layers, 2)
    return DrafterConfig.for_target(cfg, num_hidden_layers=1, target_layer_ids=taps, mask_token_id=0)


def _made_layers(target: Path) -> int | None:
    """The layer count of the sources already in --work (None: none there)."""
    try:
        return json.loads((target / "config.json").read_text()).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None


def make_sources(work: Path, size_gb: float) -> tuple[Path, Path]:
    from beamtrt.checkpoint.hf import save_checkpoint
    from beamtrt.models.dflash2 import drafter_tensor_specs
    from beamtrt.models.random_beam import write_random_beam

    target, drafter = work / "target", work / "drafter"
    cfg = source_config(size_gb)
    made = _made_layers(target)
    if made is not None and made != cfg.num_hidden_layers:  # made for another --size-gb
        print(f"{work}: replacing the {made}-layer sources with {cfg.num_hidden_layers} layers", flush=True)
        shutil.rmtree(target)
        shutil.rmtree(drafter, ignore_errors=True)
    if not (target / "config.json").is_file():
        write_random_beam(target, cfg, progress=True)
    if not (drafter / "config.json").is_file():  # written beside, then renamed: an interruption leaves nothing
        dcfg = drafter_config(cfg)
        gen = torch.Generator().manual_seed(0)
        save_checkpoint(drafter, ((n, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
                                  for n, (shape, _, _) in drafter_tensor_specs(dcfg).items()), dcfg)
    return target, drafter


def run_build(target: Path, drafter: Path, out: Path, precision: str, tp: int) -> dict:
    cmd = [sys.executable, str(ROOT / "build" / "build_engines.py"), "--precision", precision, "--model", str(target),
           "--drafter", str(drafter), "--tp", str(tp), "--out", str(out), "--quiet", "--force"]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:  # not a pipe: a build writing more than a pipe holds would block
        with ending_with_us(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)) as proc:
            _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: Popen must not wait for it again
        seconds = time.perf_counter() - start
        log.seek(0)
        err = log.read()
    if proc.returncode != 0:
        raise BeamtrtError(f"build failed ({precision}): {child_error(err, proc.returncode)}")
    manifest = json.loads((out / "manifest.json").read_text())
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024,
            "stage_seconds": {k: v.get("seconds") for k, v in manifest["stages"].items() if v.get("seconds")}}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description="Benchmark build_engines.py conversion speed and peak memory on a random "
                                   "Beam-architecture checkpoint (generated once into --work).")
    p.add_argument("--work", type=Path, default=ROOT / "bench" / "convert",
                   help="folder for the generated sources and the builds, replaced as needed, so a folder holding "
                        "anything else is refused (default: bench/convert)")
    p.add_argument("--size-gb", type=float, default=4.5,
                   help="source checkpoint size in GB, rounded to whole MoE layers of about 0.2 GB each (default: "
                        "%(default)s, which makes 21 layers, 4.3 GB)")
    p.add_argument("--precisions", nargs="+", default=["bf16", "nvfp4", "fp8"], choices=("bf16", "fp8", "nvfp4"),
                   help="precisions to build (default: %(default)s)")
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel ranks (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the results to this file")
    args = p.parse_args(argv)

    def body() -> None:
        if not 0 < args.size_gb < float("inf") or args.tp < 1:
            raise BeamtrtError(f"--size-gb must be a finite number > 0 and --tp >= 1, got {args.size_gb} and {args.tp}")
        if args.json:
            output_path(args.json, "--json")
            outside_inputs(args.json, "--json", [("--work", args.work)])  # its contents are replaced
        free = free_bytes(args.work)  # a build alone needs --size-gb: beyond the disk, said before any config is made
        reused = args.size_gb * 1e9 <= free and (
            _made_layers(args.work / "target") == source_config(args.size_gb).num_hidden_layers)
        need = args.size_gb * (1 if reused else 2)  # the sources unless make_sources reuses them, one build at a time
        if not need * 1e9 <= free:
            raise BeamtrtError(f"--size-gb {args.size_gb}: needs about {need:.3g} GB free under {args.work}, "
                               f"{free / 1e9:.3g} GB are")
        from beamtrt.checkpoint import trtllm
        from beamtrt.errors import ConfigError

        try:  # a split the build would refuse, refused before minutes of generating the sources
            trtllm.target_units(source_config(args.size_gb), trtllm.Mapping(args.tp, 1))
        except ConfigError as e:
            raise BeamtrtError(f"--tp {args.tp}: {e}") from None
        target, drafter = make_sources(work_dir(args.work, "bench_convert.py"), args.size_gb)
        weights = sum(f.stat().st_size for f in target.glob("*.safetensors"))
        results = {"source_bytes": weights, "source_gb": round(weights / 1e9, 2), "tp": args.tp,
                   "threads": torch.get_num_threads(), "precisions": {}}
        for precision in args.precisions:
            out = args.work / f"out-{precision}"
            print(f"{precision}: building at TP {args.tp} (minutes on a large --size-gb) ...", flush=True)
            r = run_build(target, drafter, out, precision, args.tp)
            shutil.rmtree(out, ignore_errors=True)
            r["convert_mb_per_s"] = round(weights / 1e6 / r["stage_seconds"]["target"], 1)
            r["end_to_end_mb_per_s"] = round(weights / 1e6 / r["seconds"], 1)
            results["precisions"][precision] = r
            print(f"{precision}: convert {r['convert_mb_per_s']} MB/s, end to end {r['end_to_end_mb_per_s']} MB/s "
                  f"({r['seconds']:.0f} s), peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
        if args.json:
            write_json(args.json, results)

    return run_cli(body)
