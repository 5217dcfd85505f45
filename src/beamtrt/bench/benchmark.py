"""The published-table benchmark: per family, acceptance length (greedy / sampled, block 8 and 16, per position) and
decode speedup of speculative over plain decoding at each concurrency, measured side by side in one run.

For every family and concurrency c the same requests run twice, plain and speculative, on the same loaded model; the
side that runs first alternates from one cell of the table to the next, so that a drift of a shared host's speed, or
a cost the first of two runs pays, does not bias every speedup the same way; before the first cell, both sides decode
a few tokens untimed (a warm-up). Decode throughput counts the tokens after each request's first (which prefill
produces either way) over the time spent in decode steps. Greedy speculative outputs are compared with the plain ones
token by token and the result is reported, never assumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from beamtrt.checkpoint.hf import followed, make_parent, write_json
from beamtrt.cli_util import (ArgumentParser, check_threads, description, output_path, outside_inputs, run_ranks_cli,
                              set_threads, signals_held, torch_device)
from beamtrt.config import check_block_size, check_draft_threshold
from beamtrt.errors import BeamtrtError
from beamtrt.prompts import load_tokenizer, make_decode, render_chat, render_chats, utf8_text
from beamtrt.runtime.loader import BACKENDS, DTYPES, Sources

SAMPLED = (0.7, 0.99)  # temperature, top-p of the published sampled column
OUT_EXTS = (".json", ".md", ".png")  # what --out OUT writes
WARMUP_TOKENS = 4  # before the first measurement, the first family's first prompts decode this many tokens each way


@dataclass
class Run:
    outputs: list[list[int]]
    decode_tokens_per_s: float
    acceptance_length: float | None
    per_position: list[float | None]
    tau_requests: int  # the requests acceptance_length averages over: those that reached a verify step


def decode(target, drafter, block_size: int, requests, concurrency: int, params, draft_threshold: float = 0.0,
           on_finish=None) -> Run:
    from beamtrt.spec.decoder import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, drafter, block_size if drafter is not None else 1, params,
                                 draft_threshold=draft_threshold)
    done = decoder.generate(requests, concurrency=concurrency, on_finish=on_finish)
    summary = decoder.metrics.summary()
    tokens = sum(len(c.output_ids) - 1 for c in done)  # the first token of each request comes from prefill
    return Run(outputs=[c.output_ids for c in done],
               decode_tokens_per_s=tokens / decoder.times.total_s if decoder.times.total_s else 0.0,
               acceptance_length=summary["acceptance_length"] if drafter is not None else None,
               per_position=summary["per_position_acceptance"], tau_requests=summary["requests_with_steps"])


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def decode_point(plain: Run, spec: Run, c: int, spec_first: bool) -> dict:
    """One family's plain and speculative runs of the same requests at concurrency c, as a JSON cell. The values the
    table shows are not rounded here: the table rounds them once (1.1251× was stored as 1.125, then shown 1.12×)."""
    diverged = [first_divergence(a, b) for a, b in zip(plain.outputs, spec.outputs)]
    return {"requests": len(plain.outputs), "effective_concurrency": min(c, len(plain.outputs)),
            "first": "speculative" if spec_first else "plain",
            "no_spec_tok_s": plain.decode_tokens_per_s, "spec_tok_s": spec.decode_tokens_per_s,
            "speedup": spec.decode_tokens_per_s / plain.decode_tokens_per_s, "tau": spec.acceptance_length,
            "tau_requests": spec.tau_requests,
            "greedy_identical": sum(d is None for d in diverged),
            "first_divergence": {i: d for i, d in enumerate(diverged) if d is not None}}  # request -> token


def speedup_cell(point: dict, c: int) -> str:
    """One decode column's cell; a family with fewer prompts than c ran them all at once, and says how many."""
    at_once = point.get("effective_concurrency", c)
    return (f"{point['no_spec_tok_s']:.1f} → {point['spec_tok_s']:.1f} ({point['speedup']:.2f}×)" +
            (f" at c={at_once}" if at_once != c else ""))


def markdown(result: dict) -> str:
    from beamtrt.bench.prompt_sets import FAMILY_NAMES

    cs = result["concurrency"]
    head = (f"| benchmark | τ greedy / sampled (block {result['block_size']}) | τ block 16 | " +
            " | ".join(f"decode tok/s c={c}" for c in cs) + " | greedy == plain |")
    lines = [head, "|" + "---|" * (len(cs) + 4)]
    for fam in result["families"]:
        tau16 = f"{fam['tau_block16']:.2f}" if fam.get("tau_block16") is not None else "—"
        cells = [speedup_cell(fam["concurrency"][str(c)], c) for c in cs]
        same = sum(p["greedy_identical"] for p in fam["concurrency"].values())
        total = sum(p["requests"] for p in fam["concurrency"].values())
        lines.append(f"| {FAMILY_NAMES.get(fam['family'], fam['family'])} | {fam['tau_greedy']:.2f} / "
                     f"{fam['tau_sampled']:.2f} | {tau16} | " + " | ".join(cells) + f" | {same}/{total} |")
    if short := [f"{FAMILY_NAMES.get(fam['family'], fam['family'])} {kind} over {n} of {fam['prompts']}"
                 for fam in result["families"] for kind, n in fam.get("tau_requests", {}).items()
                 if n < fam["prompts"]]:
        lines.append(f"\nτ is the mean over the requests that reached a verify step (the others ended at their first "
                     f"token): {'; '.join(short)}.")
    if talks := [f"{FAMILY_NAMES.get(fam['family'], fam['family'])}'s {fam['prompts']} requests are the turns of "
                 f"{fam['conversations']} conversations" for fam in result["families"] if fam.get("conversations")]:
        lines.append(f"\n{'; '.join(talks)}; each turn after the first follows the target's greedy answer to the turn "
                     "before it.")
    if result.get("draft_threshold"):
        lines.append(f"\nDecode columns: drafts cut at a draft threshold of {result['draft_threshold']:g}; the τ "
                     "columns verify whole blocks.")
    if files := [f"{FAMILY_NAMES.get(fam['family'], fam['family'])} from {fam['prompts_file']}"
                 for fam in result["families"] if fam.get("prompts_file")]:
        lines.append(f"\nPrompts: {'; '.join(files)}.")
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> None:
    """Speedup bars per concurrency beside the acceptance-length bar, one group per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from beamtrt.bench.prompt_sets import FAMILY_NAMES

    fams = result["families"]
    cs = result["concurrency"]
    fig, ax = plt.subplots(figsize=(2.2 * len(fams) + 2, 4.2))
    width = 0.8 / (len(cs) + 1)
    for j, c in enumerate(cs):
        xs = [i + j * width for i in range(len(fams))]
        points = [f["concurrency"][str(c)] for f in fams]
        bars = ax.bar(xs, [p["speedup"] for p in points], width, label=f"speedup c={c}")
        ax.bar_label(bars, fontsize=7, labels=[f"{p['speedup']:.2f}×" + (  # as the table's cell says it
            f"\nat c={p['effective_concurrency']}" if p.get("effective_concurrency", c) != c else "") for p in points])
    ax2 = ax.twinx()
    xs = [i + len(cs) * width for i in range(len(fams))]
    bars = ax2.bar(xs, [f["tau_greedy"] for f in fams], width, color="0.6", label="acceptance length τ")
    ax2.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([i + width * len(cs) / 2 for i in range(len(fams))],
                  [FAMILY_NAMES.get(f["family"], f["family"]) for f in fams])
    ax.set_ylabel("decode speedup (×)")
    ax2.set_ylabel(f"acceptance length (block {result['block_size']})")
    ax.axhline(1.0, color="k", linewidth=0.6)
    ax.set_ylim(0, max(2.0, max(f["concurrency"][str(c)]["speedup"] for f in fams for c in cs) * 1.25))
    ax2.set_ylim(0, result["block_size"])
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper right")
    cut = f", draft threshold {result['draft_threshold']:g}" if result.get("draft_threshold") else ""
    ax.set_title(f"{Path(result['model']).name} + DFlash2, {result['precision']}, TP {result['tp']}, "
                 f"{result['device']}{cut}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from beamtrt.bench.prompt_sets import LOADERS

    p = ArgumentParser(description=description(__doc__))
    p.add_argument("--model", help="target checkpoint (default: beam-mini, created if missing)")
    p.add_argument("--drafter", help="drafter checkpoint (default: as runtime/run.py picks it)")
    p.add_argument("--engine-dir", metavar="DIR",
                   help="a build_engines.py output of any precision, instead of --model / --drafter: its target and "
                        "drafter; a build for TP N runs under `mpirun -n N` (rank 0 measures, every rank runs its "
                        "shard) or in one process")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="with --engine-dir: trt runs its engines, torch its checkpoints, auto picks trt where the "
                        "build has engines, the host can run them and one rank runs per engine (default: %(default)s)")
    p.add_argument("--families", nargs="+", default=list(LOADERS), help="benchmark families (default: all: "
                   f"{' '.join(LOADERS)})")
    p.add_argument("--prompts", action="append", default=[], metavar="FAMILY=FILE",
                   help="use this prompts JSONL for a family: {\"prompt\"} or {\"messages\"} lines as they are, "
                        "and for gsm8k, math, humaneval, mbpp and mtbench the official set's own lines too (GSM8K's "
                        "question, MATH's problem, HumanEval's prompt, MT-Bench's turns, each with the built-in "
                        "set's suffix or instruction line; MBPP's text and test_list with a line of their own); a new "
                        "family name adds a row (repeatable)")
    p.add_argument("--num-prompts", type=int, default=32,
                   help="prompts per family, the first of its set; a family stops at its set's end (GSM8K at 1,319, "
                        "the test split's size); an MT-Bench question is a prompt of two turns, each decoded, the "
                        "second after the target's greedy answer to the first (default: %(default)s)")
    p.add_argument("--c1-prompts", type=int, default=8,
                   help="requests of the concurrency-1 runs, which are sequential: the first of each family's, at most "
                        "as many as it has (an MT-Bench question's turns are two) (default: %(default)s)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 32],
                   help="concurrency levels (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=8,
                   help="verification block, in [2, 32] and at most the drafter's own block (default: %(default)s)")
    p.add_argument("--draft-threshold", type=float, default=0.0, metavar="P",
                   help="the speed runs verify only the drafts whose running product of drafter confidences is >= P "
                        "(as runtime/run.py's flag); the τ columns still verify whole blocks, from runs of their "
                        "own; 0 = whole blocks everywhere (default: %(default)s)")
    p.add_argument("--no-block16", action="store_true", help="skip the block-16 acceptance run")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="compute dtype of the torch backend (default: %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="torch device of the torch backend in one process, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = torch's default (default: %(default)s)")
    p.add_argument("--out", default="bench/benchmark", help="writes OUT.json, OUT.md and OUT.png; a trailing .json, "
                   ".md or .png is dropped first (default: %(default)s)")
    args = p.parse_args(argv)
    args.out = next((args.out[:-len(ext)] for ext in OUT_EXTS if args.out.endswith(ext)), args.out)
    return args


@dataclass(frozen=True)
class Plan:
    """Everything checked before any weight is loaded (the same on every rank)."""

    prompt_ids: dict[str, list[list[int]]]  # family -> its prompts through the target's chat template
    labels: dict[str, list[str]]  # family -> what messages call each prompt: FILE:LINE, or "family: prompt N"
    chats: dict[str, list[list[dict]]]  # family -> its prompts' chats
    later: dict[str, list[tuple[str, ...]]]  # family -> the user turns after each prompt's answer (MT-Bench's second)
    tokenizer: object  # the target's, for the later turns' prompts
    files: dict[str, str]  # family -> the --prompts file it was read from (the others: their package)
    engine_dir: Path | None
    manifest: dict | None
    backend: str
    sources: Sources  # the folders to load


def _setup(args: argparse.Namespace, dist) -> Plan:
    from beamtrt.bench.prompt_sets import load_chats
    from beamtrt.runtime.loader import check_device, find_sources, open_build, pick_backend

    files = {}
    for item in args.prompts:
        fam, sep, path = item.partition("=")
        if not sep or not fam or not path:
            raise ValueError(f"--prompts {item!r}: expected FAMILY=FILE.jsonl")
        fam = utf8_text(fam, "--prompts FAMILY")  # it names a row of the table and the chart
        if fam in files:
            raise ValueError(f"--prompts names family {fam!r} twice ({files[fam]} and {path}): give one file each")
        if "|" in fam or not fam.isprintable():
            raise ValueError(f"--prompts {item!r}: a family name cannot hold '|', a line break or other control "
                             "characters (it names a markdown table row)")
        files[fam] = path
    families = list(dict.fromkeys(args.families + [f for f in files if f not in args.families]))
    if min(args.concurrency) < 1 or args.num_prompts < 1 or args.c1_prompts < 1:
        raise ValueError("--concurrency, --num-prompts and --c1-prompts must be >= 1")
    if args.max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens must be >= 2 (decode speed counts the tokens after the first), got "
                         f"{args.max_new_tokens}")
    if os.path.basename(args.out) in ("", ".", "..") or Path(args.out).is_dir():  # not Path: it drops "/", "/."
        raise ValueError(f"--out {args.out!r}: give a file name stem, e.g. bench/benchmark (not a directory: the "
                         "files are OUT.json, OUT.md and OUT.png)")
    check_block_size(args.block_size)
    check_draft_threshold(args.draft_threshold)
    if args.engine_dir and (args.model or args.drafter):
        raise ValueError("--engine-dir benchmarks a build's own target and drafter: it cannot be combined with "
                         "--model / --drafter")
    check_threads(args.threads)
    for ext in OUT_EXTS:
        output_path(args.out + ext, "--out")
    torch_device(args.device)
    engine_dir = Path(args.engine_dir) if args.engine_dir else None
    manifest = open_build(engine_dir, dist)
    backend, _ = pick_backend(args.backend, manifest, dist.size)
    check_device(args.device, backend, dist.size)
    chats = {fam: load_chats(fam, args.num_prompts, files) for fam in families}  # before beam-mini is made
    sources = find_sources(engine_dir, manifest, backend, args.model, args.drafter, True)
    sources.check_block(args.block_size)
    reads = [*sources.inputs(engine_dir), *(("--prompts", f) for f in files.values())]
    for ext in OUT_EXTS:
        outside_inputs(args.out + ext, "--out", reads)
    tokenizer = load_tokenizer(sources.tokenizer_dir)
    labels = {fam: [label for label, _, _ in c] for fam, c in chats.items()}
    later = {fam: [more for _, _, more in c] for fam, c in chats.items()}
    chats = {fam: [chat for _, chat, _ in c] for fam, c in chats.items()}
    prompt_ids = {fam: render_chats(tokenizer, chats[fam], labels[fam])
                  for fam in chats}  # every prompt rendered before the models load
    lengths, where = [], []  # every prompt's tokens, and what a message calls it
    for fam in chats:
        lengths += map(len, prompt_ids[fam])
        where += labels[fam]
        for i, more in enumerate(later[fam]):  # a conversation's last turn holds the answers before it, each at most
            if not more:                        # --max-new-tokens tokens (checked exactly once they are decoded)
                continue
            try:  # each answer a placeholder of a token or so; a template that rejects it is left to that check
                ids = render_chat(tokenizer, chats[fam][i] + [m for turn in more for m in (
                    {"role": "assistant", "content": "x"}, {"role": "user", "content": turn})])
            except ValueError:
                continue
            lengths.append(len(ids) + len(more) * args.max_new_tokens)
            where.append(f"{labels[fam][i]}, turn {len(more) + 1} (counted with answers of --max-new-tokens tokens "
                         "before it)")
    block16 = not args.no_block16 and (sources.drafter_block or 0) >= 16  # as benchmark() decides it
    check_fit(lengths, where, args.max_new_tokens, max(args.block_size, 16 * block16), sources.context)
    return Plan(prompt_ids, labels, chats, later, tokenizer, files, engine_dir, manifest, backend, sources)


def check_fit(lengths: list[int], labels: list[str], max_new_tokens: int, verified: int, context: int | None) -> None:
    """Every prompt (of `lengths` tokens, called `labels`) fits the target's context with `max_new_tokens` and a last
    block of `verified` (the widest the run verifies), before the first family is measured: checked on the sources'
    context before the models load, and on the loaded target's."""
    from beamtrt.spec.decoder import too_long

    for label, length in zip(labels, lengths):
        if why := too_long(length, max_new_tokens, verified, context, "--max-new-tokens"):
            raise BeamtrtError(f"{label}: {why}; leave it out or lower --max-new-tokens")


def _execute(args: argparse.Namespace, plan: Plan, dist) -> None:
    """Every rank loads its backends; rank 0 measures, the others replay its calls on their shards."""
    from beamtrt.runtime import loader, tp

    set_threads(args.threads)
    dtype = DTYPES[args.dtype]
    loaded = (loader.load_hf(plan.sources.model_dir, plan.sources.drafter_dir, dtype=dtype, device=args.device)
              if plan.engine_dir is None
              else loader.load_build(plan.engine_dir, plan.manifest, dist, backend=plan.backend, dtype=dtype,
                                     device=args.device))
    driven = tp.drive(dist, loaded.target, loaded.drafter)
    if driven is None:  # a rank > 0: it replayed rank 0's calls
        return
    device = "cuda" if loaded.backend == "trt" else args.device
    result = {"model": str(plan.engine_dir or loaded.tokenizer_dir), "drafter": str(loaded.drafter_dir),
              "precision": plan.manifest["precision"] if plan.manifest else args.dtype, "dtype": args.dtype,
              "tp": dist.size, "device": device, "backend": loaded.backend, "threads": torch.get_num_threads()}
    if plan.manifest:
        result["build_tp"] = plan.manifest["mapping"]["tp_size"]
    benchmark(args, plan, *driven, result)


def conversation_turns(target, plan: Plan, fam: str, ask, batch: int, fit, on_finish=None) -> list[list[int]]:
    """A family's prompts, each conversation's turns in order: its prompt, then each later user turn (MT-Bench's
    second) in the chat after the target's greedy answer to the turn before it, as text (as the MT-Bench evaluator's
    mt_inference.py asks it; an answer ends at --max-new-tokens, as there at its --max_tokens); `ask` makes a request
    of prompt ids, `fit(prompts, labels)` refuses prompts the target cannot decode."""
    from beamtrt.spec.sampling import SamplingParams

    text = make_decode(plan.tokenizer)
    chats, later, labels = [list(chat) for chat in plan.chats[fam]], plan.later[fam], plan.labels[fam]
    asked = [[ids] for ids in plan.prompt_ids[fam]]  # conversation -> its turns' prompt ids
    for k in range(max(map(len, later), default=0)):
        going = [i for i, more in enumerate(later) if len(more) > k]
        answers = decode(target, None, 1, [ask(asked[i][-1]) for i in going], batch, SamplingParams(),
                         on_finish=on_finish).outputs
        for i, answer in zip(going, answers):
            chats[i] += [{"role": "assistant", "content": text(answer).rstrip("\ufffd")},  # no half of a cut character
                         {"role": "user", "content": later[i][k]}]
        named = [f"{labels[i]}, turn {k + 2}" for i in going]
        fit(prompts := render_chats(plan.tokenizer, [chats[i] for i in going], named), named)
        for i, ids in zip(going, prompts):
            asked[i].append(ids)
    return [ids for turns in asked for ids in turns]


def timed(run: Run, family: str) -> Run:
    """`run` if it decoded anything: when every request ended at its first token there is no step to time and no
    acceptance length, and the family's cell cannot be filled (it was a ZeroDivisionError)."""
    if not run.decode_tokens_per_s:
        raise BeamtrtError(f"{family}: every request ended at its first token, so there is no decoding to measure "
                           "(other prompts, or a model that does not end its answers at once)")
    return run


def benchmark(args: argparse.Namespace, plan: Plan, target, drafter, result: dict) -> None:
    """The published table's measurements for every family (rank 0), written to OUT.json, OUT.md and OUT.png."""
    from beamtrt.spec.decoder import Request
    from beamtrt.spec.sampling import SamplingParams

    if importlib.util.find_spec("matplotlib") is None:  # the chart, drawn at the end: said before measuring
        raise BeamtrtError("matplotlib is not installed (it draws the chart): pip install matplotlib")
    out = {ext: Path(args.out + ext) for ext in OUT_EXTS}
    eos = frozenset(target.eos_token_ids)
    greedy, sampled = SamplingParams(), SamplingParams(temperature=SAMPLED[0], top_p=SAMPLED[1])
    cs = sorted(set(args.concurrency))
    result |= {"block_size": args.block_size, "draft_threshold": args.draft_threshold,
               "max_new_tokens": args.max_new_tokens,
               "num_prompts": args.num_prompts, "c1_prompts": args.c1_prompts, "concurrency": cs,
               "sampled": {"temperature": SAMPLED[0], "top_p": SAMPLED[1]}, "families": []}
    block16 = not args.no_block16 and drafter.block_size >= 16  # a drafter of a smaller block has no τ at 16
    if not args.no_block16 and not block16:
        print(f"benchmark: no block-16 column: the drafter's own block is {drafter.block_size}", file=sys.stderr)
    fit = lambda prompts, labels: check_fit(  # noqa: E731  on the loaded target's context
        list(map(len, prompts)), labels, args.max_new_tokens, max(args.block_size, 16 * block16),
        getattr(target, "max_seq_len", None))
    for fam, ids in plan.prompt_ids.items():
        fit(ids, plan.labels[fam])
    ask = lambda ids: Request(tuple(ids), args.max_new_tokens, eos)  # noqa: E731

    def whole(n: int) -> list[int]:  # the concurrencies whose speculative run decodes all n prompts in whole blocks
        return [] if args.draft_threshold else [c for c in cs if c != 1 or n <= args.c1_prompts]

    def requests_decoded(n: int) -> int:  # plain and speculative at each concurrency, sampled, whole blocks, block 16
        return sum(2 * (min(n, args.c1_prompts) if c == 1 else n) for c in cs) + n * (1 + (not whole(n)) + block16)

    answers = {fam: sum(map(len, later)) for fam, later in plan.later.items()}  # one decoded for each later turn
    total = sum(answers[fam] + requests_decoded(len(ids) + answers[fam]) for fam, ids in plan.prompt_ids.items())
    bar = tqdm(total=total, desc="benchmark", unit="request", file=sys.stderr,
               disable=None)  # on a terminal only: piped, stderr is its JSON lines
    finished = lambda i, completion: bar.update()  # noqa: E731
    log = lambda line: bar.write(json.dumps(line), file=sys.stderr)  # noqa: E731  above the bar, not through it
    bar.set_postfix_str("warm-up")
    warm = [dataclasses.replace(ask(ids), max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens))
            for ids in next(iter(plan.prompt_ids.values()))[:max(cs)]]
    for warm_drafter in (None, drafter):  # untimed: one-time costs (a GPU's first kernels, caches) are paid here
        decode(target, warm_drafter, args.block_size, warm, max(cs), greedy, args.draft_threshold)
    result["warmup"] = {"requests": len(warm), "max_new_tokens": max(r.max_new_tokens for r in warm)}
    family_requests = {}
    for fam in plan.prompt_ids:  # each later turn after the target's answers to the turns before it
        if any(plan.later[fam]):
            bar.set_postfix_str(f"{fam}, answers to the turns before the last")
        family_requests[fam] = list(map(ask, conversation_turns(target, plan, fam, ask, max(cs), fit, finished)))
    for f, (fam, requests) in enumerate(family_requests.items()):
        row = {"family": fam, "prompts": len(requests), "prompts_file": plan.files.get(fam), "concurrency": {}}
        if answers[fam]:  # its requests are the turns of conversations
            row["conversations"] = len(plan.prompt_ids[fam])
        spec_runs = {}
        for i, c in enumerate(cs):
            bar.set_postfix_str(f"{fam}, concurrency {c}")
            reqs = requests[:args.c1_prompts] if c == 1 else requests
            spec_first = (f + i) % 2 == 1
            if spec_first:
                spec = decode(target, drafter, args.block_size, reqs, c, greedy, args.draft_threshold, finished)
            plain = decode(target, None, 1, reqs, c, greedy, on_finish=finished)
            if not spec_first:
                spec = decode(target, drafter, args.block_size, reqs, c, greedy, args.draft_threshold, finished)
            spec_runs[c] = timed(spec, fam)
            point = decode_point(timed(plain, fam), spec, c, spec_first)
            row["concurrency"][str(c)] = point
            log({"family": fam, "concurrency": c, **point})
        batch = max(cs)
        bar.set_postfix_str(f"{fam}, acceptance")
        if full := whole(len(requests)):
            widest = spec_runs[full[-1]]
        else:  # τ is over every prompt in whole blocks: the speed runs cut blocks, or decoded only --c1-prompts
            widest = decode(target, drafter, args.block_size, requests, batch, greedy, on_finish=finished)
        row["tau_greedy"] = timed(widest, fam).acceptance_length
        row["per_position_acceptance"] = widest.per_position
        samp = decode(target, drafter, args.block_size, requests, batch, sampled, on_finish=finished)
        row["tau_sampled"] = timed(samp, fam).acceptance_length
        row["per_position_acceptance_sampled"] = samp.per_position
        row["tau_requests"] = {"greedy": widest.tau_requests, "sampled": samp.tau_requests}  # of row["prompts"]
        if block16:
            row["tau_block16"] = timed(decode(target, drafter, 16, requests, batch, greedy, on_finish=finished),
                                       fam).acceptance_length
        result["families"].append(row)
        log({k: v for k, v in row.items() if k != "concurrency"})
    bar.close()
    table = markdown(result)
    into = {ext: followed(path) for ext, path in out.items() if ext != ".json"}  # a link's target, as write_json
    staged = {ext: path.with_name(f".{path.name}.tmp") for ext, path in into.items()}
    for path in into.values():
        make_parent(path)
    try:  # all three or none: the chart and the table staged, then the JSON written and the two renamed into place
        for ext, write in ((".png", lambda path: chart(result, path)), (".md", lambda path: path.write_text(table))):
            try:
                write(staged[ext])
            except OSError as e:  # matplotlib's names no file; the temporary name is not the user's
                raise BeamtrtError(f"{out[ext]}: cannot write it ({e.strerror or e})") from None
        with signals_held():  # a Ctrl-C between the renames left a new JSON beside the old table and chart
            write_json(out[".json"], result)
            for ext, tmp in staged.items():
                tmp.replace(into[ext])
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    print(table)
    print(f"wrote {', '.join(map(str, out.values()))}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_ranks_cli(lambda dist: _setup(args, dist), lambda plan, dist: _execute(args, plan, dist))
