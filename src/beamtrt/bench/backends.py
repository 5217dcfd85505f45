"""Side-by-side report of runtime/run.py --json outputs (e.g. the trt and torch backends on the same prompts).

    python -m beamtrt.bench.backends torch=run-torch.json trt=run-trt.json [--json out.json]

Greedy token identity is judged against the first run, request by request (the whole output_ids); acceptance
length and tokens/s come from each run's summary. Different backends run different kernels, so a greedy output
may legitimately diverge at a near-tie of two logits: the table reports identity, it does not fail on it. Runs of
other prompts or sampling settings (seed, temperature, top-p, top-k, new tokens, stops) are refused.
scripts/gpu_host_check.sh calls it per precision.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from beamtrt.cli_util import ArgumentParser, description, output_path, outside_inputs, run_cli
from beamtrt.errors import BeamtrtError


def load_run(path: Path) -> dict:
    """A run.py --json report, with what compare() and table() read checked: every request's output_ids (a list),
    the summary's tokens_per_s (a number) and acceptance_length (a number, or None: no verification step)."""
    try:
        run = json.loads(Path(path).read_text())
        number = (int, float)
        ok = (all(isinstance(r["output_ids"], list) for r in run["requests"]) and run["requests"]
              and isinstance(run["summary"]["tokens_per_s"], number)
              and isinstance(run["summary"]["acceptance_length"], (*number, type(None))))
    except FileNotFoundError:
        raise BeamtrtError(f"{path}: no such run report (runtime/run.py --json writes one)") from None
    except (ValueError, KeyError, IndexError, TypeError):
        ok = False
    if not ok:
        raise BeamtrtError(f"{path}: not a runtime/run.py --json report")
    return run


# the settings two runs must share to be compared (run.py --json's "settings"; the model and backend may differ)
SHARED_SETTINGS = ("seed", "temperature", "top_p", "top_k", "max_new_tokens", "stop")


def compare(runs: dict[str, dict]) -> dict:
    """{name: run report} (first = reference) -> {name: {identical, first_mismatch, acceptance_length, ...}}. Runs of
    other prompts or sampling settings than the reference's are refused (where their reports record them)."""
    names = list(runs)
    first = runs[names[0]]
    ref = [r["output_ids"] for r in first["requests"]]
    out = {}
    for name, run in runs.items():
        ids = [r["output_ids"] for r in run["requests"]]
        if len(ids) != len(ref):
            raise BeamtrtError(f"run {name!r} has {len(ids)} requests, {names[0]!r} has {len(ref)}")
        asked = [i for i, (a, b) in enumerate(zip(run["requests"], first["requests"]))
                 if "messages" in a and "messages" in b and a["messages"] != b["messages"]]
        if asked:
            raise BeamtrtError(f"run {name!r} asked other prompts than {names[0]!r} (request {asked[0]} first): "
                               "compare runs of the same prompts")
        settings, ref_settings = run.get("settings") or {}, first.get("settings") or {}
        for key in SHARED_SETTINGS:
            if key in settings and key in ref_settings and settings[key] != ref_settings[key]:
                raise BeamtrtError(f"run {name!r} ran with --{key.replace('_', '-')} {settings[key]}, {names[0]!r} "
                                   f"with {ref_settings[key]}: compare runs of the same settings")
        differ = [i for i, (a, b) in enumerate(zip(ids, ref)) if a != b]
        out[name] = {"identical": not differ, "first_mismatch": differ[0] if differ else None,
                     "acceptance_length": run["summary"]["acceptance_length"],
                     "tokens_per_s": run["summary"]["tokens_per_s"], "requests": len(ids)}
    return out


def table(result: dict, title: str = "") -> str:
    lines = [f"### {title}" if title else "", "| run | greedy tokens identical | acceptance length | tokens/s |",
             "|---|---|---|---|"]
    for name, r in result.items():
        same = "yes" if r["identical"] else f"no (request {r['first_mismatch']} differs)"
        tau = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"  # no verification step
        lines.append(f"| {name} | {same} | {tau} | {r['tokens_per_s']:.1f} |")
    return "\n".join(line for line in lines if line)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m beamtrt.bench.backends", description=description(__doc__))
    p.add_argument("runs", nargs="+", help="NAME=PATH of a runtime/run.py --json report; the first is the reference")
    p.add_argument("--title", default="", help="heading of the markdown table (default: none)")
    p.add_argument("--json", help="also write the comparison to this file")
    args = p.parse_args(argv)

    def go() -> None:
        if args.json:
            output_path(Path(args.json), "--json")  # before the table is printed
        runs, reports = {}, {}
        for item in args.runs:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise BeamtrtError(f"{item!r}: give each run as NAME=PATH")
            if name in runs or "|" in name:  # a second one replaced the first; a '|' splits the table's row
                raise BeamtrtError(f"{item!r}: give each run a name of its own, without '|'")
            runs[name], reports[name] = load_run(Path(path)), path
        if args.json:  # it replaced a report it compares
            outside_inputs(args.json, "--json", [(f"the report {name}", path) for name, path in reports.items()])
        result = compare(runs)
        print(table(result, args.title))
        if args.json:
            from beamtrt.checkpoint.hf import write_json  # imports torch: only when a file is asked for

            write_json(args.json, result)

    return run_cli(go)


if __name__ == "__main__":
    sys.exit(main())
