"""Micro-benchmark of the plugins' CUDA kernels (JSON): windowed attention's achieved bytes/s beside a device-to-device
copy of as many bytes, and the block selector's microseconds per step at batch 1 and 64 (its bytes/s likewise: the
logits it must read set its floor), at DFlash2's serving shapes; and the decode loop's verification of one step on
the GPU beside copying its logits to the host and verifying there (as the loop did before).
"""

from __future__ import annotations

import json
import sys

import torch

from beamtrt.checkpoint.hf import write_json
from beamtrt.cli_util import ArgumentParser, description, output_path, run_cli
from beamtrt.errors import DeviceError


SPIN_CYCLES_PER_CALL = 400_000  # ~0.2 ms of GPU clock per timed call: more than the host takes to queue one


def _time(fn, repeats: int) -> float:
    """Median seconds of fn() on the GPU over `repeats` runs, after warm-up, each between two CUDA events. The runs
    are queued behind a spin of the GPU (torch.cuda._sleep), so each starts as the last ends: the host's work to launch
    a call (argument checks, allocations, the launches themselves, ~10-20 µs) is not timed. Timed one at a time
    instead, that work sat between the events with the GPU idle, and at batch 1 it was most of what was measured."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    torch.cuda._sleep(SPIN_CYCLES_PER_CALL * repeats)
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(start.elapsed_time(end) / 1e3 for start, end in events)[repeats // 2]


def attention_point(batch: int, window: int, block: int, q_heads: int, kv_heads: int, head_dim: int,
                    repeats: int, cuda_cores: bool = False) -> dict:
    from beamtrt.native import cuda

    dev, io = "cuda", torch.bfloat16
    t = lambda *shape: torch.randn(*shape, device=dev, dtype=io)  # noqa: E731
    q, k, v = t(batch, block, q_heads, head_dim), *(t(batch, block, kv_heads, head_dim) for _ in range(2))
    ctx = t(batch, 1, kv_heads, head_dim)
    ring_k, ring_v = t(batch, kv_heads, window, head_dim), t(batch, kv_heads, window, head_dim)
    start = torch.full((batch,), 10 * window, dtype=torch.int32, device=dev)  # a full ring: every slot visible
    count = torch.zeros(batch, dtype=torch.int32, device=dev)
    seconds = _time(lambda: cuda.windowed_attention(q, k, v, ctx, ctx, start, count, ring_k, ring_v,
                                                    cuda_cores=cuda_cores), repeats)
    moved = 2 * ring_k.nbytes + 2 * q.nbytes + 2 * k.nbytes  # both rings read; q read and the output written
    return {"kernel": "windowed_attention", "cores": "cuda" if cuda_cores else "auto", "batch": batch,
            "window": window, "block": block, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
            **_rates(seconds, moved, repeats)}


def _rates(seconds: float, moved: int, repeats: int) -> dict:
    """A kernel's time and achieved bytes/s beside a device-to-device copy that reads and writes `moved` bytes."""
    src = torch.empty(moved // 4, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    copy_seconds = _time(lambda: dst.copy_(src), repeats)
    copy_rate = 2 * src.nbytes / copy_seconds
    return {"us": round(seconds * 1e6, 1), "bytes": moved, "bytes_per_s": moved / seconds,
            "copy_bytes_per_s": copy_rate, "fraction_of_copy": round(moved / seconds / copy_rate, 3)}


def selector_point(batch: int, slots: int, vocab: int, top_k: int, rank: int, repeats: int,
                   logits_dtype: torch.dtype = torch.bfloat16) -> dict:
    from beamtrt.native import cuda

    dev = "cuda"
    logits = torch.randn(batch, slots, vocab, device=dev).to(logits_dtype)
    projected = torch.randn(batch, slots, rank, device=dev)
    anchors = torch.randint(0, vocab, (batch,), dtype=torch.int32, device=dev)
    a, b = (torch.randn(vocab, rank, device=dev, dtype=torch.bfloat16) for _ in range(2))
    temperature = torch.full((batch,), 0.7, device=dev)
    top_p = torch.full((batch,), 0.99, device=dev)
    uniforms = torch.rand(batch, slots, device=dev)
    seconds = _time(lambda: cuda.block_selector(logits, projected, anchors, a, b, temperature, top_p, uniforms, top_k),
                    repeats)
    moved = logits.nbytes + projected.nbytes + 2 * batch * slots * top_k * rank * a.element_size()  # + codebook rows
    return {"kernel": "block_selector", "batch": batch, "slots": slots, "vocab": vocab, "top_k": top_k, "rank": rank,
            "logits": str(logits_dtype).removeprefix("torch."), **_rates(seconds, moved, repeats)}


def verify_point(batch: int, drafts: int, vocab: int, top_k: int, sampled: bool, repeats: int,
                 device: str = "cuda") -> dict:
    """One step's verification (beamtrt.spec) where the logits are, against copying them to the host and verifying
    there (what the decode loop did before): milliseconds of each, wall clock, synchronized."""
    import time

    from beamtrt.spec.sampling import SamplingParams, target_probs
    from beamtrt.spec.verify import verify_greedy, verify_sampled

    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, drafts + 1, vocab, device=device, generator=g)
    cand = torch.randint(0, vocab, (batch, drafts, top_k), device=device, generator=g)
    q = torch.softmax(torch.randn(batch, drafts, top_k, device=device, generator=g), -1)
    ids = cand[..., 0]
    u, u_last = torch.rand(batch, drafts, device=device, generator=g), torch.rand(batch, device=device, generator=g)
    params = SamplingParams(0.7, 0.99) if sampled else SamplingParams()

    def step(logits, ids, cand, q, u, u_last):
        if sampled:
            result = verify_sampled(ids, cand, q, target_probs(logits, params), u, u_last)
        else:
            result = verify_greedy(ids, logits)
        return result.tokens.cpu()  # what the decoder brings back

    def on_host():
        return step(*(t.cpu() for t in (logits, ids, cand, q, u, u_last)))

    def timed(fn, repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device != "cpu":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    here = timed(lambda: step(logits, ids, cand, q, u, u_last), repeats)
    host = timed(on_host, min(repeats, 3))  # seconds a call at batch 32 when sampling: a few suffice
    return {"kernel": "verification", "batch": batch, "drafts": drafts, "vocab": vocab, "sampled": sampled,
            "device_ms": round(here * 1e3, 3), "host_ms": round(host * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=description(__doc__))
    p.add_argument("--repeats", type=int, default=50, help="timed runs per point; a verification point takes at most "
                   "10 of them on the GPU and 3 on the host (default: %(default)s)")
    p.add_argument("--json", help="also write the JSON result here")
    args = p.parse_args(argv)

    def run() -> None:
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if args.json:
            output_path(args.json, "--json")
        if not torch.cuda.is_available():
            raise DeviceError("no CUDA device here: the kernel micro-benchmark needs a GPU")
        points = [attention_point(32, 4096, 8, 40, 8, 128, args.repeats, cuda_cores) for cuda_cores in (False, True)]
        points += [selector_point(batch, 7, vocab, 16, 256, args.repeats) for vocab in (151_936, 49_152)
                   for batch in (1, 64)]  # Beam's vocabulary and beam-mini's, bf16 logits as the drafter emits them
        points.append(selector_point(64, 7, 151_936, 16, 256, args.repeats, torch.float32))  # fp32: twice the reads
        checks = [verify_point(batch, 7, 151_936, 16, sampled, min(args.repeats, 10)) for sampled in (False, True)
                  for batch in (1, 32)]  # the decode loop's verification, on the GPU and as it was on the host
        result = {"device": torch.cuda.get_device_name(), "points": points, "verification": checks}
        print("| kernel | shape | µs | achieved | vs copy |", file=sys.stderr)
        print("|---|---|---|---|---|", file=sys.stderr)
        for pt in points:
            if pt["kernel"] == "windowed_attention":
                name = f"windowed attention ({pt['cores']} cores)"
                shape = f"N {pt['batch']}, W {pt['window']}, {pt['kv_heads']} KV x {pt['head_dim']}"
            else:
                name, shape = "block selector", f"N {pt['batch']}, V {pt['vocab']}, K {pt['top_k']}, {pt['logits']}"
            print(f"| {name} | {shape} | {pt['us']} | {pt['bytes_per_s'] / 1e9:.0f} GB/s | "
                  f"{pt['fraction_of_copy']:.2f} of {pt['copy_bytes_per_s'] / 1e9:.0f} GB/s |", file=sys.stderr)
        print("\n| verification (V 151,936, 7 drafts) | batch | on the GPU (ms) | copied to the host (ms) |",
              file=sys.stderr)
        print("|---|---|---|---|", file=sys.stderr)
        for pt in checks:
            print(f"| {'sampled' if pt['sampled'] else 'greedy'} | {pt['batch']} | {pt['device_ms']} | "
                  f"{pt['host_ms']} |", file=sys.stderr)
        print(json.dumps(result, indent=2))
        if args.json:
            write_json(args.json, result)

    return run_cli(run)
