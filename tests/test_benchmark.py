"""scripts/benchmark.py end to end on a small random target: the table, the JSON, the chart, the exactness check."""

from __future__ import annotations

import io
import json

import pytest
from conftest import Terminal

from beamtrt.bench.benchmark import main


@pytest.fixture(scope="module")
def result(mini_vocab_sources, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("bench") / "b"
    src = mini_vocab_sources
    with pytest.MonkeyPatch.context() as mp:  # the progress bar, written where the test can read it
        mp.setattr("sys.stderr", progress := Terminal())
        rc = main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "chat",
                   "--prompts", f"chat={src / 'prompts.jsonl'}", "--num-prompts", "3", "--c1-prompts", "2",
                   "--concurrency", "1", "2", "--max-new-tokens", "6", "--out", str(out)])
    assert rc == 0
    out.with_suffix(".stderr").write_text(progress.getvalue())
    return out


def test_piped_stderr_is_json_lines_without_a_bar(mini_vocab_sources, tmp_path, one_thread, monkeypatch):
    src = mini_vocab_sources
    monkeypatch.setattr("sys.stderr", piped := io.StringIO())
    assert main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "chat", "--prompts",
                 f"chat={src / 'prompts.jsonl'}", "--num-prompts", "2", "--c1-prompts", "1", "--concurrency", "1",
                 "--max-new-tokens", "4", "--no-block16", "--out", str(tmp_path / "b")]) == 0
    lines = piped.getvalue().splitlines()
    assert "\r" not in piped.getvalue() and "benchmark:" not in piped.getvalue()
    assert [json.loads(line)["family"] for line in lines[:2]] == ["chat", "chat"]  # the c = 1 point, then the row


def test_a_progress_bar_counts_every_request_decoded(result):
    """2 prompts plain and speculative at c = 1, 3 each at c = 2, then 3 sampled and 3 at block 16: 16 requests."""
    bars = result.with_suffix(".stderr").read_text().split("\r")
    assert "benchmark: 100%" in bars[-1] and "16/16" in bars[-1]


def test_outputs_follow_the_published_format(result):
    data = json.loads(result.with_suffix(".json").read_text())
    fam = data["families"][0]
    assert fam["family"] == "chat" and fam["prompts"] == 3
    assert (data["precision"], data["tp"], data["device"], data["backend"]) == ("float32", 1, "cpu", "torch")
    assert set(fam["concurrency"]) == {"1", "2"} and fam["concurrency"]["1"]["requests"] == 2
    assert [fam["concurrency"][c]["first"] for c in ("1", "2")] == ["plain", "speculative"]  # alternating order
    for point in fam["concurrency"].values():
        assert point["greedy_identical"] == point["requests"]  # speculative greedy == plain greedy, checked
        assert point["speedup"] == pytest.approx(point["spec_tok_s"] / point["no_spec_tok_s"], rel=1e-2)
    assert 1 <= fam["tau_greedy"] <= 8 and 1 <= fam["tau_sampled"] <= 8 and 1 <= fam["tau_block16"] <= 16
    assert len(fam["per_position_acceptance"]) == 7
    assert fam["tau_requests"] == {"greedy": 3, "sampled": 3}  # every request reached a verify step
    assert all(point["tau_requests"] == point["requests"] for point in fam["concurrency"].values())
    table = result.with_suffix(".md").read_text()
    assert "| chat |" in table and "→" in table and "×)" in table and "5/5 |" in table
    assert fam["prompts_file"].endswith("prompts.jsonl") and f"Prompts: chat from {fam['prompts_file']}." in table
    assert result.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| τ greedy / sampled (block 8) |" in table.splitlines()[0]


def test_greedy_acceptance_covers_every_prompt_at_concurrency_1_alone(result, mini_vocab_sources, tmp_path, one_thread,
                                                                     monkeypatch):
    """With --concurrency 1 only, τ greedy came from the --c1-prompts prompts timed there, in a row that says it covers
    all of them: now a whole-block run decodes every prompt (the bar counts it; on this random drafter τ is ~1 however
    many prompts, so the fixture's equal τ is a consistency check only)."""
    src, out = mini_vocab_sources, tmp_path / "c1"
    monkeypatch.setattr("sys.stderr", progress := Terminal())
    assert main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "chat", "--prompts",
                 f"chat={src / 'prompts.jsonl'}", "--num-prompts", "3", "--c1-prompts", "1", "--concurrency", "1",
                 "--max-new-tokens", "6", "--no-block16", "--out", str(out)]) == 0
    fam, full = (json.loads(p.with_suffix(".json").read_text())["families"][0] for p in (out, result))
    assert fam["concurrency"]["1"]["requests"] == 1 and fam["prompts"] == 3
    assert (fam["tau_greedy"], fam["per_position_acceptance"]) == (full["tau_greedy"], full["per_position_acceptance"])
    assert "8/8" in progress.getvalue().split("\r")[-1]  # 1 + 1 at c = 1, 3 greedy over all, 3 sampled


def test_table_names_the_verified_block(result):
    from beamtrt.bench.benchmark import markdown

    data = json.loads(result.with_suffix(".json").read_text()) | {"block_size": 4}
    assert "| τ greedy / sampled (block 4) |" in markdown(data).splitlines()[0]


def test_a_column_says_when_fewer_requests_ran_at_once(result):
    """--concurrency 32 on a family of 2 prompts runs 2 at once: the cell says so (its column read c=32 alone)."""
    from beamtrt.bench.benchmark import markdown

    data = json.loads(result.with_suffix(".json").read_text())
    assert " at c=" not in markdown(data)
    fam = data["families"][0]
    fam["concurrency"]["32"] = fam["concurrency"].pop("2")
    data["concurrency"] = [1, 32]
    row = next(line for line in markdown(data).splitlines() if line.startswith("| chat |"))
    assert row.split(" | ")[4].endswith("×) at c=2") and "decode tok/s c=32" in markdown(data)


def test_tau_over_fewer_requests_and_a_bar_at_fewer_at_once_say_so(result, monkeypatch, tmp_path):
    """A request that ends at its first token has no verify step and no τ: the mean was over the others without a
    word (the JSON kept no count). And the chart's bar for --concurrency 32 on a family of 2 prompts said c=32 where
    the table's cell says 'at c=2'."""
    import matplotlib.axes

    from beamtrt.bench.benchmark import chart, markdown

    data = json.loads(result.with_suffix(".json").read_text())
    assert "τ is the mean over" not in markdown(data)
    fam = data["families"][0]
    fam["tau_requests"]["greedy"] = 2
    assert ("τ is the mean over the requests that reached a verify step (the others ended at their first token): "
            "chat greedy over 2 of 3.") in markdown(data)
    fam["concurrency"]["32"] = fam["concurrency"].pop("2")
    data["concurrency"] = [1, 32]
    labels = []
    bar_label = matplotlib.axes.Axes.bar_label
    monkeypatch.setattr(matplotlib.axes.Axes, "bar_label",
                        lambda self, bars, **kw: labels.append(kw.get("labels")) or bar_label(self, bars, **kw))
    chart(data, tmp_path / "b.png")
    speedup = fam["concurrency"]["32"]["speedup"]
    assert labels[1] == [f"{speedup:.2f}×\nat c=2"] and "\n" not in labels[0][0]


def test_out_names_three_files_whatever_its_suffix():
    from beamtrt.bench.benchmark import parse_args

    assert parse_args(["--out", "runs/run.v2"]).out == "runs/run.v2"  # OUT.json: run.v2.json, not run.json
    assert parse_args(["--out", "runs/run.json"]).out == "runs/run"
    assert parse_args([]).out == "bench/benchmark"


@pytest.mark.parametrize("args, needle", [
    (["--families", "nosuch"], "unknown benchmark family 'nosuch'"),
    (["--families", "nosuch"], "or give --prompts nosuch=FILE.jsonl"),
    (["--prompts", "gsm8k"], "expected FAMILY=FILE.jsonl"),
    (["--prompts", "x=a.jsonl", "--prompts", "x=b.jsonl"], "--prompts names family 'x' twice (a.jsonl and b.jsonl)"),
    (["--prompts", "a|b=a.jsonl"], "a family name cannot hold '|'"),
    (["--prompts", "a\nb=a.jsonl"], "cannot hold '|', a line break or other control characters"),  # broke the table
    (["--families", "x", "--prompts", "x=/nonexistent.jsonl"], "cannot read the prompts file"),
    (["--concurrency", "0"], "must be >= 1"),
    (["--block-size", "1"], "--block-size must be in [2, 32]"),
    (["--threads", "-1"], "--threads must be in [0, "),
    (["--threads", "100000"], "--threads must be in [0, "),
    (["--max-new-tokens", "1"], "--max-new-tokens must be >= 2"),
    (["--out", "."], "give a file name stem"),
    (["--out", "new/"], "give a file name stem"),  # it wrote new/.json, new/.md and new/.png
    (["--out", "new/."], "give a file name stem"),
    (["--out", ""], "argument --out: an empty value"),
    (["--out", "/tmp"], "not a directory: the files are OUT.json, OUT.md and OUT.png"),
    (["--engine-dir", "/nonexistent-build"], "no such directory"),
    (["--engine-dir", "/nonexistent-build", "--model", "m"], "cannot be combined"),
    (["--device", "gpu0"], "not a torch device"),
    (["--backend", "trt"], "pass --engine-dir"),
])
def test_bad_arguments_are_one_line(args, needle, capsys, tmp_path, monkeypatch):
    from beamtrt.models import beam_mini

    monkeypatch.setattr(beam_mini, "ensure_beam_mini", lambda *a: pytest.fail("beam-mini made before the refusal"))
    try:
        code = main(["--out", str(tmp_path / "b")] + args)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not (tmp_path / "b").exists() and list(tmp_path.iterdir()) == []  # nothing made before the work


def test_a_family_with_nothing_decoded_is_one_line():
    """Every request ending at its first token leaves nothing to time: one line naming the family, where the speedup
    was a ZeroDivisionError."""
    from beamtrt.bench.benchmark import Run, timed
    from beamtrt.errors import BeamtrtError

    ran = Run(outputs=[[5, 7]], decode_tokens_per_s=12.5, acceptance_length=1.5, per_position=[], tau_requests=1)
    assert timed(ran, "gsm8k") is ran
    with pytest.raises(BeamtrtError, match="^gsm8k: every request ended at its first token"):
        timed(Run(outputs=[[2]], decode_tokens_per_s=0.0, acceptance_length=None, per_position=[], tau_requests=0),
              "gsm8k")


def test_a_failure_at_the_end_writes_none_of_the_three_files(mini_vocab_sources, tmp_path, monkeypatch, one_thread,
                                                            capsys):
    """The JSON was written, then the table, then the chart: a chart that failed left a new JSON and table beside an
    old chart. Now all three are written and renamed into place together, or none. matplotlib's error on a full disk
    names no file ('error: No space left on device'): the message names the chart's."""
    import beamtrt.bench.benchmark as bench

    def no_room(result, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "chart", no_room)
    src = mini_vocab_sources
    rc = main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "chat", "--prompts",
               f"chat={src / 'prompts.jsonl'}", "--num-prompts", "2", "--c1-prompts", "1", "--concurrency", "1",
               "--max-new-tokens", "4", "--no-block16", "--out", str(tmp_path / "b")])
    assert rc == 2 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err.endswith(f"error: {tmp_path / 'b.png'}: cannot write it (No space left on device)\n")


def test_a_prompt_too_long_for_the_target_is_refused_before_any_family_is_measured(mini_vocab_sources, tmp_path,
                                                                                  monkeypatch, one_thread, capsys):
    """A request that does not fit the target's context failed inside the decoder, after the families before it had
    been measured (and with the request's index, not its family's prompt number); then it was refused after the
    models loaded (minutes on a large build), naming the family's prompt number: now its file and line, before."""
    import beamtrt.bench.benchmark as bench
    from beamtrt.runtime import loader

    monkeypatch.setattr(bench, "decode", lambda *a, **k: pytest.fail("a family was measured"))
    monkeypatch.setattr(loader, "load_hf", lambda *a, **k: pytest.fail("the models were loaded"))
    src = mini_vocab_sources
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "Hi."}) + "\n\n" + json.dumps({"prompt": "go " * 33000}))
    rc = main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "chat", "long",
               "--prompts", f"chat={src / 'prompts.jsonl'}", "--prompts", f"long={tmp_path / 'long.jsonl'}",
               "--num-prompts", "2", "--c1-prompts", "1", "--concurrency", "1", "--max-new-tokens", "4",
               "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines()[-1].startswith(f"error: {tmp_path / 'long.jsonl'}:3: its prompt ("), err
    assert "more than the target's context of 32768 tokens; leave it out or lower --max-new-tokens" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.jsonl"]


def test_prompts_that_cannot_be_rendered_are_refused_before_the_models_load(mini_vocab_sources, tmp_path,
                                                                            monkeypatch, capsys):
    """A target without tokenizer files was a transformers TypeError traceback, a chat its template rejects a jinja2
    traceback, both after the models loaded; a family name that is not UTF-8 a matplotlib traceback after the whole
    benchmark had run. Each is one line now, before anything loads."""
    from beamtrt.runtime import loader

    monkeypatch.setattr(loader, "load_hf", lambda *a, **k: pytest.fail("the models were loaded"))
    src = mini_vocab_sources
    no_tok, strict = tmp_path / "no-tok", tmp_path / "strict"
    for folder in (no_tok, strict):
        folder.mkdir()
        for f in (src / "target").iterdir():
            if folder is strict or not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                (folder / f.name).symlink_to(f)
    (strict / "chat_template.jinja").unlink()  # a template that wants a user turn first, as Mistral's does
    (strict / "chat_template.jinja").write_text("{% if messages[0]['role'] != 'user' %}{{ raise_exception("
                                                "'Conversation roles must alternate user/assistant') }}{% endif %}"
                                                "{{ messages }}")
    (tmp_path / "sys.jsonl").write_text(json.dumps({"prompt": "Hi."}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]}) + "\n")
    common = ["--drafter", str(src / "drafter"), "--families", "sys", "--prompts", f"sys={tmp_path / 'sys.jsonl'}",
              "--num-prompts", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "out" / "b")]
    for model, needle in ((no_tok, f"error: {no_tok}: no tokenizer files"),
                          (strict, (f"error: {tmp_path / 'sys.jsonl'}:2: the chat template rejected it "
                                    "(Conversation roles must alternate user/assistant)"))):
        assert main(["--model", str(model), *common]) == 2
        err = capsys.readouterr().err
        assert err.startswith(needle) and len(err.splitlines()) == 1, err
    assert main(["--model", str(src / "target"), *common[:4], "--prompts", f"f\udcff={tmp_path / 'sys.jsonl'}",
                 *common[6:]]) == 2
    assert capsys.readouterr().err.startswith("error: --prompts FAMILY: not valid UTF-8 text (character 2)")
    assert not (tmp_path / "out").exists()


def test_the_official_sets_lines_are_read_as_the_built_in_sets_prompts(tmp_path):
    """--prompts gsm8k=FILE refused GSM8K's own lines (and MATH's, MBPP's, MT-Bench's: only {"prompt"} and
    {"messages"} were read), and HumanEval's were read without the built-in set's instruction line."""
    from beamtrt.bench.prompt_sets import CODE_PREFIX, MATH_SUFFIX, MBPP_PREFIX, load_chats
    from beamtrt.errors import BeamtrtError

    lines = {"gsm8k": {"question": "2 + 2?", "answer": "#### 4"},
             "math": {"problem": "Solve x.", "solution": "x", "level": "Level 1"},
             "humaneval": {"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f", "test": ""},
             "mbpp": {"task_id": 11, "text": "Add.", "code": "", "test_list": ["assert add(1) == 2"]},
             "mtbench": {"question_id": 81, "category": "writing", "turns": ["Write.", "Again."]}}
    prompts = {"gsm8k": "2 + 2?" + MATH_SUFFIX, "math": "Solve x." + MATH_SUFFIX,
               "humaneval": CODE_PREFIX + "def f():\n", "mtbench": "Write.",
               "mbpp": MBPP_PREFIX + "Add.\nIt must pass these tests:\nassert add(1) == 2"}
    for fam, line in lines.items():
        (path := tmp_path / f"{fam}.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({"prompt": "as is"}) + "\n")
        later = ("Again.",) if fam == "mtbench" else ()  # MT-Bench's second turn, asked after the first's answer
        assert load_chats(fam, 9, {fam: str(path)}) == [
            (f"{path}:1", [{"role": "user", "content": prompts[fam]}], later),
            (f"{path}:2", [{"role": "user", "content": "as is"}], ())]
    with pytest.raises(BeamtrtError, match=r"gsm8k.jsonl:1: expected .* \(its fields: question, answer\)"):
        load_chats("chat", 9, {"chat": str(tmp_path / "gsm8k.jsonl")})  # a family of no official layout
    (bad := tmp_path / "bad.jsonl").write_text(json.dumps({"turns": []}) + "\n")
    with pytest.raises(BeamtrtError, match=r"bad.jsonl:1: this MT-Bench line \(it has 'turns'\) needs \"turns\""):
        load_chats("mtbench", 9, {"mtbench": str(bad)})
    for turns in (["Write.", " "], ["Write.", 2]):  # a second turn of nothing, or not text
        bad.write_text(json.dumps({"turns": turns}) + "\n")
        with pytest.raises(BeamtrtError, match=r"bad.jsonl:1: this MT-Bench line \(it has 'turns'\) needs"):
            load_chats("mtbench", 9, {"mtbench": str(bad)})
    bad.write_text(json.dumps({"turns": ["Write.", "caf\ud800"]}) + "\n")  # a lone surrogate, as in a first turn
    with pytest.raises(BeamtrtError, match=r"bad.jsonl:1: not valid UTF-8 text"):
        load_chats("mtbench", 9, {"mtbench": str(bad)})
    bad.write_text(json.dumps({"text": "Add.", "test_list": "assert add(1) == 2"}) + "\n")  # a str, not a list
    with pytest.raises(BeamtrtError, match=r"this MBPP line \(it has 'test_list'\) needs"):
        load_chats("mbpp", 9, {"mbpp": str(bad)})
    bad.write_text(json.dumps({"question": "  "}) + "\n")  # it became a prompt of spaces and the suffix
    with pytest.raises(BeamtrtError, match=r"this GSM8K line \(it has 'question'\) needs \"question\": a non-empty"):
        load_chats("gsm8k", 9, {"gsm8k": str(bad)})
    own = [{"question": "Q?", "prompt": "mine"},  # a line with its own prompt or chat is taken as it is
           {"question": "Q?", "messages": [{"role": "user", "content": "my chat"}]},
           {"task_id": "Mbpp/2", "prompt": "Write f.", "test_list": ["assert f()"]}]  # MBPP sanitized: no "text"
    bad.write_text("".join(json.dumps(line) + "\n" for line in own))
    for fam in ("gsm8k", "mbpp"):
        read = [chat[0]["content"] for _, chat, _ in load_chats(fam, 9, {fam: str(bad)})]
        assert read == ["mine", "my chat", "Write f."]


def test_a_ctrl_c_while_the_files_are_renamed_leaves_all_three_new(mini_vocab_sources, tmp_path, monkeypatch,
                                                                     one_thread, capsys):
    """Ctrl-C between the JSON's rename and the table's left a new JSON beside an old table and chart: the renames now
    run with the signals held, which arrive when they are done."""
    import os
    import signal

    import beamtrt.bench.benchmark as bench

    real = bench.write_json
    monkeypatch.setattr(bench, "write_json", lambda *a: (real(*a), os.kill(os.getpid(), signal.SIGINT)))
    for ext in (".json", ".md", ".png"):
        (tmp_path / f"b{ext}").write_text("old")
    src = mini_vocab_sources
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite started in the background ignores it
    try:
        rc = main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "chat",
                   "--prompts", f"chat={src / 'prompts.jsonl'}", "--num-prompts", "1", "--concurrency", "1",
                   "--max-new-tokens", "2", "--no-block16", "--out", str(tmp_path / "b")])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back after the renames
    finally:
        signal.signal(signal.SIGINT, saved)
    assert rc == 130 and capsys.readouterr().err.endswith("interrupted\n")
    assert [(tmp_path / f"b{ext}").read_bytes() != b"old" for ext in (".json", ".md", ".png")] == [True] * 3


def test_a_block_that_fails_with_a_signal_held_keeps_its_error():
    """A full disk while the signal waited was reported as 'interrupted', its error lost."""
    import os
    import signal

    from beamtrt.cli_util import signals_held

    saved = signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite started in the background ignores it
    try:
        with pytest.raises(OSError, match="No space left on device"), signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError(28, "No space left on device")
    finally:
        signal.signal(signal.SIGINT, saved)


def test_generated_gsm8k_stops_at_the_test_split_size():
    """gsm_symbolic generates without end: --num-prompts 99999999 ran for minutes instead of stopping at 1,319."""
    pytest.importorskip("reasoning_gym")
    from beamtrt.bench.prompt_sets import GSM8K_SIZE, gsm8k

    assert GSM8K_SIZE == 1319
    assert len(gsm8k(2000)) == GSM8K_SIZE
    assert gsm8k(3) == gsm8k(GSM8K_SIZE)[:3]  # the first N of the same set


def test_the_table_rounds_each_value_once():
    """The JSON keeps the measured values; the table rounds them (a speedup of 1.12501 was stored as 1.125 and then
    shown as 1.12×)."""
    from beamtrt.bench.benchmark import Run, decode_point, speedup_cell

    plain, spec = (Run([[1, 2, 3]], tok_s, 2.0, [0.5], 1) for tok_s in (100.0, 112.501))
    point = decode_point(plain, spec, 1, spec_first=False)
    assert point["speedup"] == 1.12501 and point["greedy_identical"] == 1 and point["first_divergence"] == {}
    spec = Run([[1, 2, 3], [4, 5], [6]], 1.0, 2.0, [0.5], 3)  # which requests differed, and where (it kept the
    plain = Run([[1, 2, 3], [4, 6], [6, 7]], 1.0, 2.0, [0.5], 3)  # positions of the first five alone)
    assert decode_point(plain, spec, 1, spec_first=False)["first_divergence"] == {1: 1, 2: 1}
    assert speedup_cell(point, 1) == "100.0 → 112.5 (1.13×)"


def test_a_warm_up_comes_first_and_links_are_written_through(mini_vocab_sources, tmp_path, one_thread, monkeypatch):
    """Both sides decode a few tokens untimed before the first measured run (a GPU's first kernels are not timed);
    --out files that are symbolic links are written at their targets, the links kept (the table and chart replaced
    the links while the JSON was written through them)."""
    from beamtrt.bench import benchmark

    calls = []
    real = benchmark.decode
    monkeypatch.setattr(benchmark, "decode", lambda target, drafter, block, requests, c, params, *a, **k: (
        calls.append((drafter is not None, {r.max_new_tokens for r in requests}, (a[1:] or [k.get("on_finish")])[0]
                      is not None)),  # counted on the bar: a measured run
        real(target, drafter, block, requests, c, params, *a, **k))[1])
    (tmp_path / "real").mkdir()
    for ext in (".json", ".md", ".png"):
        (tmp_path / f"b{ext}").symlink_to(tmp_path / "real" / f"x{ext}")
    src = mini_vocab_sources
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert benchmark.main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "chat",
                           "--prompts", f"chat={src / 'prompts.jsonl'}", "--num-prompts", "2", "--c1-prompts", "1",
                           "--concurrency", "1", "--max-new-tokens", "6", "--no-block16",
                           "--out", str(tmp_path / "b")]) == 0
    assert calls[:2] == [(False, {benchmark.WARMUP_TOKENS}, False), (True, {benchmark.WARMUP_TOKENS}, False)]
    assert all(tokens == {6} and timed for _, tokens, timed in calls[2:])
    assert json.loads((tmp_path / "real/x.json").read_text())["warmup"] == {"requests": 1, "max_new_tokens": 4}
    for ext in (".json", ".md", ".png"):
        assert (tmp_path / f"b{ext}").is_symlink() and (tmp_path / "real" / f"x{ext}").stat().st_size > 0
    assert benchmark.main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "chat",
                           "--prompts", f"chat={src / 'prompts.jsonl'}", "--num-prompts", "1", "--concurrency", "1",
                           "--max-new-tokens", "2", "--no-block16", "--out", str(tmp_path / "short")]) == 0
    assert json.loads((tmp_path / "short.json").read_text())["warmup"] == {"requests": 1, "max_new_tokens": 2}  # not 4


def test_mt_bench_second_turns_follow_the_targets_greedy_answer_to_the_first(mini_vocab_sources, tmp_path, monkeypatch,
                                                                              one_thread):
    """MT-Bench's second turns were never decoded (its first turns alone were the family). Now each conversation's
    second turn is a request of its own, asked in the chat after the target's greedy answer to the first (as text,
    through the chat template), right after its first turn; a line of one turn stays one request."""
    import beamtrt.bench.benchmark as bench
    from beamtrt.prompts import load_tokenizer, make_decode, render_chat

    src = mini_vocab_sources
    talks = [{"question_id": 81, "turns": ["Write a haiku.", "Now in French."]}, {"prompt": "Hi."},
             {"question_id": 82, "turns": ["Name a color.", "And another?"]}]
    (tmp_path / "mt.jsonl").write_text("".join(json.dumps(line) + "\n" for line in talks))
    calls, decode = [], bench.decode
    monkeypatch.setattr(bench, "decode", lambda target, drafter, block, requests, c, params, *a, **k: calls.append(
        (drafter, requests, params, run := decode(target, drafter, block, requests, c, params, *a, **k))) or run)
    monkeypatch.setattr("sys.stderr", progress := Terminal())
    assert main(["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "mtbench",
                 "--prompts", f"mtbench={tmp_path / 'mt.jsonl'}", "--num-prompts", "3", "--c1-prompts", "2",
                 "--concurrency", "2", "--max-new-tokens", "5", "--no-block16", "--out", str(tmp_path / "b")]) == 0
    tokenizer = load_tokenizer(src / "target")
    (drafter, answered, params, answers), (_, requests, _, _) = calls[2:4]  # after the warm-up: the first answers
    first = [render_chat(tokenizer, [{"role": "user", "content": t["turns"][0]}]) for t in (talks[0], talks[2])]
    assert [list(r.prompt_ids) for r in answered] == first and drafter is None and params.temperature == 0
    assert all(make_decode(tokenizer)(answer) for answer in answers.outputs)  # text between the turns
    second = [render_chat(tokenizer, [{"role": "user", "content": t["turns"][0]},
                                      {"role": "assistant", "content": make_decode(tokenizer)(answer)},
                                      {"role": "user", "content": t["turns"][1]}])
              for t, answer in zip((talks[0], talks[2]), answers.outputs)]
    hi = render_chat(tokenizer, [{"role": "user", "content": "Hi."}])
    assert [list(r.prompt_ids) for r in requests] == [first[0], second[0], hi, first[1], second[1]]
    fam = json.loads((tmp_path / "b.json").read_text())["families"][0]
    assert (fam["prompts"], fam["conversations"], fam["concurrency"]["2"]["greedy_identical"]) == (5, 3, 5)
    assert "MT-Bench's 5 requests are the turns of 3 conversations; each turn after the first follows the target's " \
           "greedy answer to the turn before it." in (tmp_path / "b.md").read_text()
    assert "17/17" in progress.getvalue().split("\r")[-1]  # 2 answers, then 5 each: plain, speculative (τ), sampled


def test_a_second_turn_that_may_not_fit_is_refused_before_the_models_load(mini_vocab_sources, tmp_path, monkeypatch,
                                                                           one_thread, capsys):
    """A second turn's prompt holds the first turn's answer, up to --max-new-tokens: a conversation whose two turns
    cannot fit the target's context with their answers is refused before anything loads, naming its turn; a first
    turn that cannot fit itself is named alone."""
    from beamtrt.runtime import loader

    monkeypatch.setattr(loader, "load_hf", lambda *a, **k: pytest.fail("the models were loaded"))
    src = mini_vocab_sources
    (tmp_path / "mt.jsonl").write_text(json.dumps({"turns": ["Write.", "Again."]}) + "\n")
    args = ["--model", str(src / "target"), "--drafter", str(src / "drafter"), "--families", "mtbench", "--prompts",
            f"mtbench={tmp_path / 'mt.jsonl'}", "--concurrency", "1", "--no-block16", "--out", str(tmp_path / "b")]
    assert main(args + ["--max-new-tokens", "16370"]) == 2  # the first turn fits with its answer, the second not
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: {tmp_path / 'mt.jsonl'}:1, turn 2 (counted with answers of --max-new-tokens tokens "
                          "before it): its prompt ("), err
    assert "more than the target's context of 32768 tokens" in err
    assert main(args + ["--max-new-tokens", "32760"]) == 2  # nor does the first
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {tmp_path / 'mt.jsonl'}:1: its prompt (")


def test_each_later_turn_follows_its_own_conversations_answer(mini_vocab_sources, monkeypatch):
    """Lines of three, one and two turns mixed: each later turn is asked after its own conversation's greedy answer
    (one decode per turn, of the conversations still going), an answer cut inside a character puts no U+FFFD into the
    chat, and each turn's prompts are checked to fit, named by line and turn, before the next answers are decoded."""
    import beamtrt.bench.benchmark as bench
    from beamtrt.prompts import load_tokenizer, render_chat
    from beamtrt.spec.decoder import Request

    tok = load_tokenizer(mini_vocab_sources / "target")
    chats = [[{"role": "user", "content": turn}] for turn in ("A?", "B?", "C?")]
    later = [("A2?", "A3?"), (), ("C2?",)]
    first = [render_chat(tok, chat) for chat in chats]
    plan = bench.Plan({"f": first}, {"f": ["f:1", "f:2", "f:3"]}, {"f": chats}, {"f": later}, tok, {}, None, None,
                      "torch", None)
    cut = tok.encode("😀", add_special_tokens=False)[:1]  # the first byte of the emoji: decoded as U+FFFD
    events = []

    def decode(target, drafter, block, requests, batch, params, **kwargs):  # the answer to a prompt names its length
        events.append(("decode", params.temperature, [list(r.prompt_ids) for r in requests]))
        outputs = [tok.encode(f" answer {len(r.prompt_ids)}", add_special_tokens=False) + cut for r in requests]
        return bench.Run(outputs, 1.0, None, [], len(requests))

    monkeypatch.setattr(bench, "decode", decode)
    got = bench.conversation_turns(None, plan, "f", lambda ids: Request(tuple(ids), 8), 4,
                                   lambda prompts, labels: events.append(("fit", labels, prompts)))

    def said(*turns: tuple[list[int], str]) -> list[dict]:  # each answer to a prompt, then the next question
        return [m for prompt, q in turns for m in ({"role": "assistant", "content": f" answer {len(prompt)}"},
                                                   {"role": "user", "content": q})]

    a2, c2 = render_chat(tok, chats[0] + said((first[0], "A2?"))), render_chat(tok, chats[2] + said((first[2], "C2?")))
    a3 = render_chat(tok, chats[0] + said((first[0], "A2?"), (a2, "A3?")))
    assert got == [first[0], a2, a3, first[1], first[2], c2]
    assert events == [("decode", 0.0, [first[0], first[2]]), ("fit", ["f:1, turn 2", "f:3, turn 2"], [a2, c2]),
                      ("decode", 0.0, [a2]), ("fit", ["f:1, turn 3"], [a3])]
    assert "\ufffd" not in tok.decode(a3)
