"""Decode-throughput benchmark: tokens/s per batch size, dtype and step path beside the weight-streaming bound, as JSON.

The bound at batch 1 is (weight bytes one decode step must read) / (matrix-vector bandwidth): the bandwidth is that
of one large GEMV in the same dtype -- the faster of PyTorch's and the host kernels' (beamtrt.native) -- measured in
rounds interleaved with the decode steps, so the ratio says how much of the step is spent on anything other than
streaming weights. Both step paths (the fused host kernel and eager PyTorch) are measured in the same run.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from beamtrt import native
from beamtrt.checkpoint.hf import write_json
from beamtrt.cli_util import (ArgumentParser, description, output_path, outside_inputs, progress, run_cli, say,
                              set_threads)
from beamtrt.config import BeamConfig
from beamtrt.errors import DeviceError
from beamtrt.models.beam import BeamForCausalLM, load_beam
from beamtrt.runtime.loader import DTYPES


def active_weight_bytes(model: BeamForCausalLM) -> int:
    """Bytes of weights one single-token decode step reads: attention, router, top-k experts, dense MLPs, LM head."""
    cfg, size = model.cfg, model.dtype.itemsize
    total = 0
    for i, layer in enumerate(model.layers):
        total += sum(p.numel() for p in layer.attn.parameters()) + 2 * cfg.hidden_size
        if cfg.is_moe_layer(i):
            moe = layer.mlp
            total += moe.router.weight.numel() + cfg.num_experts_per_tok * (moe.w_gate_up[0].numel() + moe.w_down[0].numel())
            if moe.shared is not None:
                total += sum(p.numel() for p in moe.shared.parameters()) + moe.shared_gate.weight.numel()
        else:
            total += sum(p.numel() for p in layer.mlp.parameters())
    total += cfg.vocab_size * cfg.hidden_size + cfg.hidden_size  # LM head + final norm (embedding row: negligible)
    return total * size


class GemvProbe:
    """y = W x with W far larger than the caches, through PyTorch and through the host kernels: the matrix-vector
    bandwidth a decode step could reach."""

    def __init__(self, dtype: torch.dtype, mbytes: int = 256, cols: int = 4096):
        self.w = torch.randn(mbytes * 2**20 // (cols * dtype.itemsize), cols).to(dtype)
        self.x = torch.randn(1, cols).to(dtype)
        self.gemvs = {"torch": lambda: self.x @ self.w.T}
        if native.available():
            self.gemvs["native"] = lambda: native.gemm(self.x, self.w)
        for gemv in self.gemvs.values():
            gemv()  # warm-up

    def seconds(self) -> dict[str, float]:
        times = {}
        for name, gemv in self.gemvs.items():
            t = time.perf_counter()
            gemv()
            times[name] = time.perf_counter() - t
        return times

    @property
    def bytes(self) -> int:
        return self.w.numel() * self.w.dtype.itemsize


@contextlib.contextmanager
def step_path(path: str):
    """Run the model's CPU steps on `path`: "native" (the fused host kernel) or "torch" (eager PyTorch)."""
    old = os.environ.get("BEAMTRT_NATIVE")
    os.environ["BEAMTRT_NATIVE"] = "1" if path == "native" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["BEAMTRT_NATIVE"]
        else:
            os.environ["BEAMTRT_NATIVE"] = old


def measure(model: BeamForCausalLM, probe: GemvProbe, batch: int, context: int, steps: int, paths: list[str],
            rounds: int = 4) -> tuple[dict[str, float], dict[str, float]]:
    """({path: decode tokens/s}, {GEMV: bytes/s}), medians over `rounds` interleaved rounds of probe GEMVs and of
    decode steps on every path, so that all see the same machine (a shared host drifts by tens of percent within a
    minute)."""
    from beamtrt.models.beam import KVCache, check_cache_fits

    positions = context + steps + 8
    check_cache_fits(f"KV caches of {len(paths)} path(s) x {batch} rows x {positions} positions",  # held at once
                     KVCache.shape(model.cfg, len(paths) * batch, positions), model.dtype, model.device)
    caches, tokens = {}, {}
    for path in paths:
        with step_path(path):
            cache = model.new_cache(batch, positions)
            gen = torch.Generator().manual_seed(0)
            model(torch.randint(0, model.cfg.vocab_size, (batch, context), generator=gen), cache, last_only=True)
            token = torch.randint(0, model.cfg.vocab_size, (batch, 1), generator=gen)
            for _ in range(2):
                token = model(token, cache).logits[:, -1].argmax(-1, keepdim=True)
            cache.crop(cache.lengths - 2)
            caches[path], tokens[path] = cache, token
    step_times = {path: [] for path in paths}
    probe_times = {name: [] for name in probe.gemvs}
    for r in range(rounds):  # `steps` timed steps in all, spread over the rounds
        per_round = steps // rounds + (r < steps % rounds)
        for _ in range(5):
            for name, seconds in probe.seconds().items():
                probe_times[name].append(seconds)
        for path in paths:
            with step_path(path):
                for _ in range(per_round):
                    t = time.perf_counter()
                    tokens[path] = model(tokens[path], caches[path]).logits[:, -1].argmax(-1, keepdim=True)
                    step_times[path].append(time.perf_counter() - t)
    return ({path: batch / statistics.median(times) for path, times in step_times.items()},
            {name: probe.bytes / statistics.median(times) for name, times in probe_times.items()})


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=description(__doc__))
    p.add_argument("--model", help="Beam-layout checkpoint (default: beam-mini, created if missing)")
    p.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES),
                   help="compute dtypes (default: %s)" % " ".join(DTYPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16], help="batch sizes (default: %(default)s)")
    p.add_argument("--context", type=int, default=64,
                   help="prefill length in tokens before decoding (default: %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per point (default: %(default)s)")
    p.add_argument("--paths", nargs="+", choices=("native", "torch"), default=["native", "torch"],
                   help="step paths to measure side by side: the fused host kernel and eager PyTorch, each run with "
                        "BEAMTRT_NATIVE set for it (a valid value in the environment is replaced) (default: both)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = torch's default (default: %(default)s)")
    p.add_argument("--json", help="also write the JSON result here")
    args = p.parse_args(argv)

    def run() -> None:
        from beamtrt.models.beam_mini import ensure_beam_mini

        if min(args.batches) < 1 or args.steps < 1 or args.context < 1:
            raise ValueError("--batches, --steps and --context must be >= 1")
        if "native" in args.paths and not native.available():
            raise DeviceError("--paths native: the host kernels could not be built here (see the line above)")
        set_threads(args.threads)
        if args.json:
            output_path(args.json, "--json")
        model_dir = Path(args.model) if args.model else ensure_beam_mini()
        cfg = BeamConfig.from_file(model_dir / "config.json")
        if args.context + max(args.steps, 2) > cfg.max_position_embeddings:  # 2 warm-up steps, cropped
            raise ValueError(f"--context {args.context} + --steps {args.steps} exceed the model's context of "
                             f"{cfg.max_position_embeddings} tokens")
        if args.json:
            outside_inputs(args.json, "--json", [("the target", model_dir)])
        result = {"model": str(model_dir), "threads": torch.get_num_threads(), "context": args.context,
                  "steps": args.steps, "device": "cpu", "results": []}
        bar = progress(len(args.dtypes) * len(args.batches), "bench_decode")
        for name in args.dtypes:
            model = load_beam(model_dir, dtype=DTYPES[name], cfg=cfg)
            probe = GemvProbe(DTYPES[name])
            step_bytes = active_weight_bytes(model)
            for batch in args.batches:
                bar.set_postfix_str(f"{name} batch {batch}")
                rates, bandwidths = measure(model, probe, batch, args.context, args.steps, args.paths)
                bandwidth = max(bandwidths.values())
                bound = bandwidth / step_bytes  # tokens/s at batch 1 if only weight streaming took time
                for path, rate in rates.items():
                    point = {"dtype": name, "batch": batch, "path": path, "tokens_per_s": round(rate, 2),
                             "gemv_bandwidth_gb_s": {k: round(v / 1e9, 2) for k, v in bandwidths.items()},
                             "active_weight_mb_per_step": round(step_bytes / 1e6, 1),
                             "weight_streaming_bound_tokens_per_s": round(bound * batch, 2)}
                    if batch == 1:
                        point["fraction_of_bound"] = round(rate / bound, 3)
                    result["results"].append(point)
                    say(bar, json.dumps(point), sys.stderr)
                bar.update()
            del model, probe
        bar.close()
        print(json.dumps(result, indent=2))
        if args.json:
            write_json(args.json, result)

    return run_cli(run)
