"""Drafter training: the training forward is the serving forward, feature capture is exact, resume is exact."""

from __future__ import annotations

import dataclasses
import math
import json
import os
from types import SimpleNamespace

import pytest
import torch

from beamtrt.errors import BeamtrtError
from beamtrt.runtime.generate import generate
from beamtrt.train.features import FeatureSet, answer_with_taps, load_features, target_digest
from beamtrt.runtime.torch_backend import TorchDrafter, TorchTarget
from beamtrt.spec.decoder import Request, SpeculativeDecoder
from beamtrt.train.trainer import (HeadSlice, TrainConfig, block_forward, block_labels, block_losses, check_state,
                                   decode_steps, evaluate, split, teacher_logits, train)
from conftest import tiny_model
from test_dflash2 import TAPS, make_cfg, make_drafter


@pytest.fixture(scope="module")
def target(one_thread):
    return tiny_model().requires_grad_(False)


def _answers(target, prompts, max_new: int, eos_ids=(), sampled=None, batch=None, seed: int = 0):
    """answer_with_taps's (all tokens, taps) per prompt, in the prompts' order."""
    got = {i: (ids, taps) for i, ids, taps in answer_with_taps(
        target, prompts, TAPS, eos_ids, max_new, sampled or [False] * len(prompts),
        seeds=[seed * 1000 + i for i in range(len(prompts))], temperature=0.7, top_p=0.99, batch=batch)}
    return [got[i] for i in range(len(prompts))]


def _features(target, n: int = 6, seed: int = 0, max_new: int = 12) -> FeatureSet:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, target.cfg.vocab_size, (int(torch.randint(3, 9, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(n)]
    seqs = _answers(target, prompts, max_new, sampled=[i % 3 == 2 for i in range(n)], seed=seed)
    return _feature_set([(ids, taps.to(torch.bfloat16)) for ids, taps in seqs], prompts,
                        greedy=[i % 3 != 2 for i in range(n)])


def _feature_set(seqs, prompts, greedy) -> FeatureSet:
    """[(all token ids, taps [T, F])] with their prompts and greedy flags -> one FeatureSet."""
    lengths = torch.tensor([len(ids) for ids, _ in seqs])
    return FeatureSet(ids=torch.tensor([t for ids, _ in seqs for t in ids]), taps=torch.cat([f for _, f in seqs]),
                      seq_start=torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))),
                      prompt_len=torch.tensor([len(p) for p in prompts]), greedy=torch.tensor(greedy))


def test_captured_taps_equal_a_full_forward(target):
    """Taps gathered token by token while answering equal one forward over the finished sequence; greedy answers
    equal plain greedy decoding."""
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2]]
    got = _answers(target, prompts, 7)
    assert [ids[len(p):] for (ids, _), p in zip(got, prompts)] == generate(target, prompts, 7)
    for ids, taps in got:
        cache = target.new_cache(1, len(ids))
        full = torch.cat(target(torch.tensor([ids]), cache, taps=TAPS).taps, dim=-1)[0]
        assert taps.shape == full.shape
        torch.testing.assert_close(taps, full, rtol=1e-5, atol=1e-5)


def test_answers_stop_at_eos(target):
    got = _answers(target, [[5, 9, 2, 7]], 6)
    eos = got[0][0][6]  # the third answer token becomes the EOS: the answer must end there, EOS kept
    ids, taps = _answers(target, [[5, 9, 2, 7]], 6, eos_ids=[eos])[0]
    first = got[0][0][4:].index(eos) + 4
    assert ids == got[0][0][:first + 1] and taps.shape[0] == len(ids)


def test_training_forward_is_the_serving_forward(target):
    """block_forward (all anchors of one sequence at once) equals append_context + draft per anchor, including a
    context longer than the window and non-trivial convolutions and selector."""
    drafter = make_drafter(target)  # sliding_window 16, block 8
    ids = torch.randint(1, target.cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    taps = torch.cat(target(ids[None], target.new_cache(1, 30), taps=TAPS).taps, dim=-1)[0]
    anchors = torch.tensor([2, 9, 21])
    with torch.no_grad():
        logits, hidden = block_forward(drafter, ids, taps, anchors, 8)
    for n, p in enumerate(anchors.tolist()):
        cache = drafter.new_cache(1)
        drafter.append_context(cache, taps[None, :p])
        out = drafter.draft(cache, ids[p:p + 1], 8)
        torch.testing.assert_close(logits[n], out.logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden[n], out.hidden[0], rtol=1e-5, atol=1e-5)
    labels = block_labels(ids, anchors, 8)
    assert labels[0].tolist() == ids[3:10].tolist() and labels[2].tolist() == ids[22:29].tolist()


def test_teacher_forced_scores_are_lattice_rows(target):
    drafter = make_drafter(target)
    gen = torch.Generator().manual_seed(2)
    logits, hidden = torch.randn(2, 5, target.cfg.vocab_size, generator=gen), torch.randn(2, 5, 64, generator=gen)
    anchors = torch.tensor([3, 7])
    with torch.no_grad():
        cand, lattice = drafter.candidate_selector.edge_scores(logits, hidden, anchors, 4)
        prev = torch.cat((anchors[:, None], cand[:, :-1, 2]), dim=1)  # slot t's predecessor: candidate 2 of t-1
        cand_tf, scores = drafter.candidate_selector.teacher_forced_scores(logits, hidden, prev, 4)
    assert torch.equal(cand_tf, cand)
    torch.testing.assert_close(scores[:, 0], lattice[:, 0, 0])
    torch.testing.assert_close(scores[:, 1:], lattice[:, 1:, 2])


TINY_RUN = TrainConfig(steps=10, seqs_per_step=2, anchors_per_seq=4, block_size=8, eval_block_size=4, lr=3e-3,
                       eval_every=3, checkpoint_every=2, eval_sequences=2)


def test_resume_repeats_the_uninterrupted_run(target, tmp_path):
    """Also with other save and eval periods, which change no weight (a resume refused them)."""
    data, uninterrupted = _features(target), make_drafter(target)
    whole = train(uninterrupted, data, TINY_RUN, tmp_path / "a", quiet=True)
    interrupted = make_drafter(target)
    first = train(interrupted, data, TINY_RUN, tmp_path / "b", quiet=True, stop_after=3)
    assert len(first) == 3
    periods = dataclasses.replace(TINY_RUN, checkpoint_every=5, eval_every=4)
    drafter = make_drafter(target, seed=9)
    resumed = train(drafter, data, periods, tmp_path / "b", quiet=True)  # weights from disk
    strip = [{k: v for k, v in row.items() if k != "seconds" and not k.startswith("eval_")} for row in whole]
    assert [{k: v for k, v in row.items() if k != "seconds" and not k.startswith("eval_")} for row in resumed] == strip
    assert [row["step"] for row in resumed if "eval_tau" in row] == [3, 4, 8, 10]  # the new period after step 3
    assert _without_seconds(resumed[-1:]) == _without_seconds(whole[-1:])  # the last step's eval included
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted.state_dict().values(), drafter.state_dict().values()))
    losses = [row["loss"] for row in whole]  # one step's loss is noisy (other sequences): compare 3-step means
    assert any("eval_tau" in row for row in whole) and sum(losses[-3:]) < sum(losses[:3])


def _without_seconds(log: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "seconds"} for row in log]


class _HostStepAdamW(torch.optim.AdamW):
    """AdamW whose own step runs with the host as default device: torch 2.9's makes its step counter on the default
    device (2.13's on the host), which is torch's doing, not the trainer's."""

    def step(self, closure=None):
        with torch.device("cpu"):
            return super().step(closure)


def test_training_makes_no_tensor_on_the_default_device(target, tmp_path, monkeypatch):
    """What --device cuda rests on, checked without a GPU: answering with taps and a training run (head slice, evals,
    an interruption and its resume) make every tensor on their inputs' or models' device. Under a default device of
    "meta", a tensor made without one has no data (reading it fails, the host kernels refuse it), so equal answers
    and an equal log mean none was made."""
    monkeypatch.setattr(torch.optim, "AdamW", _HostStepAdamW)
    prompts = [[5, 9, 2, 7], [11, 3]]
    plain = _answers(target, prompts, 6, sampled=[False, True])
    with torch.device("meta"):
        meta = _answers(target, prompts, 6, sampled=[False, True])
    assert [ids for ids, _ in meta] == [ids for ids, _ in plain]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(meta, plain))
    data, cfg = _features(target), dataclasses.replace(TINY_RUN, steps=4, head_vocab="seen")
    whole = train(make_drafter(target), data, cfg, tmp_path / "a", quiet=True)
    first, second = make_drafter(target), make_drafter(target, seed=9)  # made outside: their init draws on the host
    with torch.device("meta"):
        train(first, data, cfg, tmp_path / "b", quiet=True, stop_after=2)
        resumed = train(second, data, cfg, tmp_path / "b", quiet=True)
    assert any("eval_tau" in row for row in whole) and _without_seconds(resumed) == _without_seconds(whole)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_follows_the_cpu_run(target, tmp_path):
    """--device cuda: the same anchors (drawn on the host) and the same initial weights give the CPU run's losses and
    held-out τ up to fp32 rounding, and a state saved on the GPU resumes on the CPU."""
    data, cfg = _features(target), dataclasses.replace(TINY_RUN, steps=4, head_vocab="seen")
    cpu = train(make_drafter(target), data, cfg, tmp_path / "cpu", quiet=True)
    on_gpu = tiny_model().requires_grad_(False).to("cuda")
    drafter = make_drafter(on_gpu)
    assert drafter.device.type == "cuda"
    train(drafter, data, cfg, tmp_path / "cuda", quiet=True, stop_after=2)
    gpu = train(make_drafter(target, seed=9), data, cfg, tmp_path / "cuda", quiet=True)  # resumed on the host
    assert len(gpu) == len(cpu)
    for a, b in zip(cpu, gpu):
        assert a.keys() == b.keys()
        for key in ("loss", "base", "selector", "eval_tau_every_anchor"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-3), (a["step"], key)


def test_decode_steps_walks_like_the_decoder():
    # anchors 0 (3 tokens) -> 3 (2) -> 5 (1) -> 6 (1) -> 7 (1): 8 tokens in 5 steps
    assert decode_steps(torch.tensor([3, 1, 1, 2, 5, 1, 1, 1])) == 5
    assert decode_steps(torch.tensor([2, 4, 3, 1])) == 2  # the second step runs past the end: it commits what is left
    assert decode_steps(torch.ones(7)) == 7 and decode_steps(torch.tensor([8, 7, 6, 5, 4, 3, 2, 1])) == 1


def test_eval_tau_is_the_decoders_acceptance_length(target, tmp_path):
    """A briefly trained drafter, so that blocks are sometimes accepted: evaluate's τ on the decoder's own greedy
    answers is the decoder's acceptance length (committed tokens / steps), and the every-anchor mean is not."""
    block, new = 4, 24
    cfg = TrainConfig(steps=60, seqs_per_step=4, anchors_per_seq=8, block_size=8, eval_block_size=block, lr=3e-3,
                      eval_every=1000, checkpoint_every=1000, eval_sequences=3)
    drafter = make_drafter(target)
    train(drafter, _features(target, n=16, max_new=new), cfg, tmp_path, quiet=True)
    drafter.eval()
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2]]
    done = SpeculativeDecoder(TorchTarget(target), TorchDrafter(drafter), block).generate(
        [Request(tuple(p), new) for p in prompts])
    seqs = [p + c.output_ids for p, c in zip(prompts, done)]
    with torch.no_grad():
        seqs = [(s, torch.cat(target(torch.tensor([s]), target.new_cache(1, len(s)), taps=TAPS).taps, dim=-1)[0])
                for s in seqs]
    data = _feature_set(seqs, prompts, greedy=[True] * len(prompts))
    got = evaluate(drafter, data, [0, 1, 2], cfg, chunk=5)
    tau = sum(c.committed for c in done) / sum(c.steps for c in done)
    assert tau > 1.05 and got["eval_tau"] == round(tau, 4)
    assert got["eval_tau_every_anchor"] != got["eval_tau"]
    answered = {t for s, _ in seqs for t in s}
    drafter.set_draft_vocab([t for t in range(target.cfg.vocab_size) if t not in answered])  # none of their tokens
    got = evaluate(drafter, data, [0, 1, 2], cfg, chunk=5)  # drafts as the decoder does (it drafted from all tokens)
    assert got["eval_tau"] == got["eval_tau_top1"] == 1.0 and got["eval_recall"] == 0.0


def test_head_slice_losses(target, tmp_path):
    """A slice of the whole vocabulary gives the full head's losses and gradients; the "seen" slice holds every
    training label, maps its candidates and top-1 back to token ids, and scores only its own rows."""
    data, cfg = _features(target), dataclasses.replace(TINY_RUN, anchors_per_seq=6)
    train_ids, _ = split(data, cfg)
    ids, taps, prompt = data.sequence(train_ids[0])
    anchors = torch.arange(prompt, ids.shape[0] - 1)[:6]
    drafter = make_drafter(target)
    results = []
    for head in (None, HeadSlice.of(target, torch.arange(target.cfg.vocab_size))):
        drafter.zero_grad()
        out = block_losses(drafter, ids, taps.float(), anchors, cfg, head)
        (out["base"] / out["base_w"] + out["sel"] / out["sel_w"].clamp(min=1e-9)).backward()
        results.append(({k: v.detach() for k, v in out.items()}, [p.grad.clone() for p in drafter.parameters()
                                                                   if p.grad is not None]))
    (full, g_full), (whole, g_whole) = results
    for k in full:
        torch.testing.assert_close(whole[k], full[k])
    for a, b in zip(g_full, g_whole, strict=True):
        torch.testing.assert_close(a, b)
    seen = HeadSlice.of(target, torch.cat([data.sequence(i)[0] for i in train_ids]))
    assert seen.ids.shape[0] < target.cfg.vocab_size and torch.equal(seen.ids, seen.ids.sort().values)
    labels = block_labels(ids, anchors, cfg.block_size)
    assert bool((seen.index[labels[labels >= 0]] >= 0).all())
    assert torch.equal(seen.ids[seen.index[seen.ids]], seen.ids)
    with torch.no_grad():
        sliced = block_losses(drafter, ids, taps.float(), anchors, cfg, seen)
        logits, _ = block_forward(drafter, ids, taps.float(), anchors, cfg.block_size, seen)
        full_logits, z = block_forward(drafter, ids, taps.float(), anchors, cfg.block_size)
        torch.testing.assert_close(logits, full_logits[..., seen.ids])
        masked = torch.full_like(full_logits, -torch.inf)
        masked[..., seen.ids] = full_logits[..., seen.ids]
        prev = labels.clamp(min=0)
        scorer = drafter.candidate_selector.teacher_forced_scores
        for a, b in zip(scorer(logits, z, prev, 4, seen.ids), scorer(masked, z, prev, 4)):
            torch.testing.assert_close(a, b)  # candidates come back as token ids
    assert float(sliced["base"]) < float(full["base"])  # fewer competitors: a lower cross-entropy on the same blocks
    with pytest.raises(ValueError, match="head vocabulary"):
        dataclasses.replace(TINY_RUN, head_vocab="some")
    trained, cfg = make_drafter(target), dataclasses.replace(TINY_RUN, head_vocab="seen", steps=3)
    log = train(trained, data, cfg, tmp_path, quiet=True)
    assert torch.equal(trained.draft_vocab, seen.ids)  # it drafts from the slice, and its last eval drafted so
    assert {k: v for k, v in log[-1].items() if k.startswith("eval_")} == evaluate(trained, data, split(data, cfg)[1],
                                                                                   cfg)


def test_distillation_teacher_is_the_target_and_its_term_trains(target, tmp_path):
    """The teacher rebuilt from the last tap equals the target's own logits at every position (and their head-slice
    columns); --distill adds its weighted KL divergence to the loss and logs it."""
    data = _features(target)
    ids, _, _ = data.sequence(0)
    cache = target.new_cache(1, len(ids))
    out = target(ids[None], cache, taps=TAPS)
    taps = torch.cat(out.taps, dim=-1)[0]  # fp32, as captured
    drafter = make_drafter(target)
    everywhere = torch.arange(len(ids))
    torch.testing.assert_close(teacher_logits(drafter, taps, everywhere), out.logits[0], rtol=1e-5, atol=1e-5)
    seen = HeadSlice.of(target, ids)
    pos = torch.tensor([[2, 0], [1, 3]])
    torch.testing.assert_close(teacher_logits(drafter, taps, pos, seen), out.logits[0][pos][..., seen.ids],
                               rtol=1e-5, atol=1e-5)

    cfg = dataclasses.replace(TINY_RUN, distill=0.5)
    train_ids, _ = split(data, cfg)
    seq, feats, prompt = data.sequence(train_ids[0])
    anchors = torch.arange(prompt, seq.shape[0] - 1)[:4]
    parts = block_losses(drafter, seq, feats.float(), anchors, cfg)
    assert float(parts["kd"].detach()) > 0 and "kd" not in block_losses(drafter, seq, feats.float(), anchors, TINY_RUN)
    log = train(make_drafter(target), data, dataclasses.replace(cfg, steps=3), tmp_path / "kd", quiet=True)
    for row in log:
        assert row["kd"] > 0
        assert row["loss"] == pytest.approx(row["base"] + row["selector"] + 0.5 * row["kd"], abs=1e-4)
    for bad in (-0.1, float("nan"), float("inf")):
        for field, flag in (("distill", "--distill"), ("selector_weight", "--selector-weight")):
            with pytest.raises(ValueError, match=f"{flag} must be a finite number >= 0"):
                dataclasses.replace(TINY_RUN, **{field: bad})
        with pytest.raises(ValueError, match=r"--lr must be positive \(finite\) and --gamma at least 0.01"):
            dataclasses.replace(TINY_RUN, lr=bad)
    for bad in (0.0, 1e-300, float("nan")):  # 1e-300 is 0 in fp32: the decay weights were NaN, called a divergence
        with pytest.raises(ValueError, match="--gamma at least 0.01"):
            dataclasses.replace(TINY_RUN, gamma=bad)


def test_resume_refuses_other_settings_and_corrupt_state(target, tmp_path):
    data = _features(target)
    train(make_drafter(target), data, TINY_RUN, tmp_path, quiet=True, stop_after=2)
    with pytest.raises(BeamtrtError, match="other training settings"):
        train(make_drafter(target), data, dataclasses.replace(TINY_RUN, lr=1e-3), tmp_path, quiet=True)
    with pytest.raises(BeamtrtError, match=r"other data \(6 sequences, [\d,]+ tokens, digest [0-9a-f]{16}; now 7 "
                                           r"sequences, [\d,]+ tokens, digest [0-9a-f]{16}\)"):  # Python dicts, said
        train(make_drafter(target), _features(target, n=7), TINY_RUN, tmp_path, quiet=True)  # more (or other) caches
    with pytest.raises(BeamtrtError, match="other data"):  # as many sequences and tokens, other ones
        train(make_drafter(target), _features(target, seed=1), TINY_RUN, tmp_path, quiet=True)
    with pytest.raises(BeamtrtError, match=r"another layout \(num_hidden_layers 2 \(now 1\)\): pass"):  # --layers
        train(make_drafter(target, num_hidden_layers=1), data, TINY_RUN, tmp_path, quiet=True)
    other = tiny_model(seed=5).requires_grad_(False)  # the same config, other weights
    with pytest.raises(BeamtrtError, match="another target"):
        train(make_drafter(other), data, TINY_RUN, tmp_path, quiet=True)
    state, digest = torch.load(tmp_path / "train_state.pt", weights_only=False), target_digest(target)
    with pytest.raises(BeamtrtError, match=r"another layout \(block_size 8 \(now 4\)\): pass"):  # no word of 16
        check_state(tmp_path / "train_state.pt", TINY_RUN, make_cfg(block_size=4), digest)
    old = state | {"drafter": state["drafter"] | {"block_size": 16}}  # written before drafters recorded their block
    torch.save(old, tmp_path / "train_state.pt")
    with pytest.raises(BeamtrtError, match=r"another layout \(block_size 16 \(now 8\); a state written before "
                                           r"drafters recorded the block they trained at says 16\): pass"):
        check_state(tmp_path / "train_state.pt", TINY_RUN, make_cfg(), digest)
    for field, value, said in (("step", "3", "step is str, not int"), ("config", None, "config is NoneType, not dict"),
                               ("data", {"sequences": 6}, "data.tokens is NoneType, not int")):  # hand-edited:
        torch.save(state | {field: value}, tmp_path / "train_state.pt")                     # were tracebacks
        with pytest.raises(BeamtrtError, match=f"cannot resume, the training state is damaged \\(its {said}\\)"):
            train(make_drafter(target), data, TINY_RUN, tmp_path, quiet=True)
    torch.save([1, 2], tmp_path / "train_state.pt")
    with pytest.raises(BeamtrtError, match="not a training state"):
        train(make_drafter(target), data, TINY_RUN, tmp_path, quiet=True)
    (tmp_path / "train_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(BeamtrtError, match="corrupt"):
        train(make_drafter(target), data, TINY_RUN, tmp_path, quiet=True)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (every write to it fails: disk full)")
def test_a_full_disk_while_saving_the_training_state_says_so(target, tmp_path):
    """torch.save given a path said '[enforce fail at inline_container.cc:672] . unexpected pos ...'."""
    from beamtrt.train.trainer import _save_state

    drafter = make_drafter(target)
    (tmp_path / "train_state.pt.tmp").symlink_to("/dev/full")  # where the state is written before its rename
    with pytest.raises(BeamtrtError, match=r"train_state.pt: cannot write the training state \(No space left on "
                                           r"device\)$"):
        _save_state(tmp_path / "train_state.pt", drafter, torch.optim.AdamW(drafter.parameters()), 1, TINY_RUN, [],
                    {}, "digest")
    assert list(tmp_path.iterdir()) == []


def test_divergence_stops_before_the_step(target, tmp_path):
    """A non-finite loss ends the run with one line; the training state on disk is the last sound one."""
    cfg = dataclasses.replace(TINY_RUN, lr=1e30, checkpoint_every=1)
    with pytest.raises(BeamtrtError, match=f"training diverged at step .*; the last training state in {tmp_path} is "
                                           "from before it"):
        train(make_drafter(target), _features(target), cfg, tmp_path, quiet=True)
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert all(bool(torch.isfinite(t).all()) for t in state["model"].values())
    with pytest.raises(BeamtrtError, match=r"training diverged at step .*; no training state was saved: lower --lr$"):
        train(make_drafter(target), _features(target), dataclasses.replace(cfg, checkpoint_every=100), tmp_path / "w",
              quiet=True)  # it spoke of a state from before the divergence


def test_feature_shards_round_trip_and_corruption(target, tmp_path):
    from safetensors.torch import save_file

    data = _features(target, n=3)
    save_file({"ids": data.ids, "taps": data.taps, "seq_start": data.seq_start, "prompt_len": data.prompt_len,
               "greedy": data.greedy}, str(tmp_path / "features-00000.safetensors"))
    save_file({"ids": data.ids, "taps": data.taps, "seq_start": data.seq_start, "prompt_len": data.prompt_len,
               "greedy": data.greedy}, str(tmp_path / "features-00001.safetensors"))
    both = load_features(tmp_path)
    assert len(both) == 6 and both.ids.shape[0] == 2 * data.ids.shape[0]
    for i in range(3):
        a, b = data.sequence(i), both.sequence(i + 3)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]
    other = tmp_path / "other"
    other.mkdir()
    save_file({"ids": data.ids[:0], "taps": data.taps[:0], "seq_start": torch.zeros(1, dtype=torch.long),
               "prompt_len": data.prompt_len[:0], "greedy": data.greedy[:0]}, str(other / "features-00000.safetensors"))
    assert len(load_features(other, tmp_path)) == 6  # several caches, concatenated in order
    (tmp_path / "meta.json").write_text('{"taps": [1, 2], "hidden_size": 64}')
    assert len(load_features(other, tmp_path)) == 6  # a cache made before meta.json: "the first cache has None"
    (other / "meta.json").write_text('{"taps": [0, 2]}')
    with pytest.raises(BeamtrtError, match=f"^{tmp_path}: features of target layers \\[1, 2\\], {other} has "
                                           "\\[0, 2\\]$"):
        load_features(other, tmp_path)
    (other / "meta.json").write_text('{"taps": [1, 2], "hidden_size": 32}')
    with pytest.raises(BeamtrtError, match=f"^{other}: a target hidden size of 32, {tmp_path} has 64$"):
        load_features(tmp_path, other)
    (other / "meta.json").unlink()  # its taps unknown but for their width
    save_file({"ids": data.ids[:0], "taps": data.taps[:0, :5], "seq_start": torch.zeros(1, dtype=torch.long),
               "prompt_len": data.prompt_len[:0], "greedy": data.greedy[:0]}, str(other / "features-00000.safetensors"))
    with pytest.raises(BeamtrtError, match=f"^{tmp_path / 'features-00000.safetensors'}: taps {data.taps.shape[1]} "
                                           f"wide, {other / 'features-00000.safetensors'}'s 5 \\(features of other"):
        load_features(other, tmp_path)
    (tmp_path / "meta.json").write_text('{"taps": [1, 2]}')
    (tmp_path / "features-00001.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(BeamtrtError, match="corrupt feature shard"):
        load_features(tmp_path)
    (tmp_path / "features-00001.safetensors").unlink()
    (tmp_path / "features-00001.safetensors").mkdir()  # safetensors said 'No such device'
    with pytest.raises(BeamtrtError, match="features-00001.safetensors: a directory, not a feature shard; remove it"):
        load_features(tmp_path)
    (tmp_path / "features-00001.safetensors").rmdir()
    for bad in ({"taps": data.taps[:-10]}, {"seq_start": data.seq_start[:-1]}, {"prompt_len": data.prompt_len + 999}):
        save_file({"ids": data.ids, "taps": data.taps, "seq_start": data.seq_start, "prompt_len": data.prompt_len,
                   "greedy": data.greedy, **bad}, str(tmp_path / "features-00001.safetensors"))
        with pytest.raises(BeamtrtError, match="features-00001.safetensors: corrupt feature shard .* do not fit"):
            load_features(tmp_path)
    with pytest.raises(BeamtrtError, match="no feature shards"):
        load_features(tmp_path / "missing")
    nan_taps = data.taps.clone()
    nan_taps[3, 1] = float("nan")
    save_file({"ids": data.ids, "taps": nan_taps, "seq_start": data.seq_start, "prompt_len": data.prompt_len,
               "greedy": data.greedy}, str(tmp_path / "features-00001.safetensors"))
    with pytest.raises(BeamtrtError, match="features-00001.safetensors: corrupt feature shard .*NaN"):
        load_features(tmp_path)
    save_file({"ids": data.ids, "taps": data.taps, "seq_start": data.seq_start, "prompt_len": data.prompt_len,
               "greedy": data.greedy}, str(tmp_path / "features-00001.safetensors"))
    load_features(tmp_path, vocab_size=target.cfg.vocab_size)
    with pytest.raises(BeamtrtError, match="outside the target's vocabulary of 50"):  # a smaller target's cache
        load_features(tmp_path, vocab_size=50)
    with pytest.raises(BeamtrtError, match="made by another target"):
        (tmp_path / "meta.json").write_text('{"taps": [1, 2], "target": "0123"}')
        load_features(tmp_path, digest="4567")
    load_features(tmp_path, digest="0123")
    for garbage in ("", "[1, 2]", '{"recipe": 3}'):
        (tmp_path / "meta.json").write_text(garbage)
        with pytest.raises(BeamtrtError, match="meta.json: (feature cache description|not a feature cache)"):
            load_features(tmp_path)


def test_answers_files_are_checked_before_taps_are_rebuilt(target, tmp_path):
    """A damaged answers file is one line, and no feature shard is written from it."""
    from safetensors.torch import save_file

    from beamtrt.train.features import rebuild_features

    data = _features(target, n=3)
    good = {"ids": data.ids.to(torch.int32), "seq_start": data.seq_start, "prompt_len": data.prompt_len,
            "greedy": data.greedy}
    seq_start = data.seq_start.clone()
    seq_start[-1] += 5
    for bad, message in (({"ids": None}, "no 'ids' tensor"), ({"seq_start": seq_start}, "do not fit together"),
                         ({"ids": good["ids"] + 1000}, "outside the target's vocabulary")):
        tensors = {k: v for k, v in (good | bad).items() if v is not None}
        save_file(tensors, str(tmp_path / "answers-00000.safetensors"))
        with pytest.raises(BeamtrtError, match=f"answers-00000.safetensors: .*{message}"):
            rebuild_features(target, TAPS, tmp_path, quiet=True)
        assert not (tmp_path / "features-00000.safetensors").exists()
    save_file(good, str(tmp_path / "answers-00000.safetensors"))
    rebuild_features(target, TAPS, tmp_path, quiet=True)
    assert torch.equal(load_features(tmp_path).ids, data.ids)


def test_a_cache_made_before_digests_is_tied_to_the_target_that_rebuilds_its_taps(target, tmp_path):
    """A committed cache's meta.json names no target; once one target rebuilds its taps, another is refused."""
    from safetensors.torch import save_file

    from beamtrt.train.features import TAPS_TARGET, rebuild_features, target_digest

    data = _features(target, n=3)
    save_file({"ids": data.ids.to(torch.int32), "seq_start": data.seq_start, "prompt_len": data.prompt_len,
               "greedy": data.greedy}, str(tmp_path / "answers-00000.safetensors"))
    (tmp_path / "meta.json").write_text(json.dumps({"taps": list(TAPS), "hidden_size": target.cfg.hidden_size}))
    other = tiny_model(seed=5).requires_grad_(False)
    load_digest, other_digest = target_digest(target), target_digest(other)
    assert load_digest == target_digest(tiny_model().requires_grad_(False)) != other_digest  # the same on a reload
    rebuild_features(target, TAPS, tmp_path, quiet=True)
    assert json.loads((tmp_path / TAPS_TARGET).read_text())["target"] == load_digest
    load_features(tmp_path, digest=load_digest)
    with pytest.raises(BeamtrtError, match="made by another target"):
        load_features(tmp_path, digest=other_digest)
    with pytest.raises(BeamtrtError, match="made by another target"):
        rebuild_features(other, TAPS, tmp_path, quiet=True)


def test_no_held_out_prompt_is_trained_on():
    """Caches made from the same templates repeat prompts (a greedy answer then repeats too): the held-out greedy
    answers' prompts are left out of training wherever they occur (5 of 32 were trained on, on caches 6-13)."""
    prompts = [[5, 6], [7, 8, 9], [5, 6], [10, 11], [7, 8, 9], [12, 13]]
    seqs = [(p + [20, 21, 22], torch.zeros(len(p) + 3, 4)) for p in prompts]
    data = _feature_set(seqs, prompts, greedy=[True] * 6)
    train, held = split(data, TrainConfig(eval_sequences=2))
    assert held == [4, 5] and train == [0, 2, 3]  # [7, 8, 9] is held out (4), so sequence 1 is not trained on


def test_every_mix_makes_a_few_prompts():
    """A mix's smallest shares round to no prompt at all for a handful (v4's 5% of 6); that is not an error."""
    from beamtrt.train.prompts import MIXES, tagged_prompts

    for mix in MIXES:
        got = tagged_prompts(6, seed=0, mix=mix)
        assert 1 <= len(got) <= 6 and len(set(got)) == len(got)


def test_training_prompts_are_deterministic_and_not_benchmarks():
    pytest.importorskip("reasoning_gym")
    from beamtrt.train.prompts import BOXED, CODE_PREFIX, GYM_TASKS, GYM_TASKS_V3, training_prompts

    for mix in ("v1", "v2", "v3", "v4"):
        a, b = training_prompts(60, seed=3, mix=mix), training_prompts(60, seed=3, mix=mix)
        assert a == b and len(set(a)) == len(a) and len(a) >= 50
        assert training_prompts(60, seed=4, mix=mix) != a
    assert "gsm_symbolic" not in GYM_TASKS + GYM_TASKS_V3
    v2 = training_prompts(200, seed=0)  # v2 is the default
    assert any(p.endswith(BOXED) for p in v2) and not any(p.endswith(BOXED) for p in training_prompts(200, 0, "v1"))
    assert any(p.startswith(CODE_PREFIX + "def ") and '"""' in p for p in v2)  # HumanEval-style stubs
    assert any("Continue this story" in p or "following passage" in p for p in v2)
    v3 = training_prompts(200, seed=0, mix="v3")
    boxed = lambda prompts: sum(p.endswith(BOXED) for p in prompts)  # noqa: E731
    assert boxed(v3) > boxed(v2) and any("hens lay" in p for p in training_prompts(400, seed=0, mix="v3"))
    v4 = training_prompts(200, seed=0, mix="v4")
    personas = sum(p.startswith(("Pretend to be", "From now on, act as", "Embody", "You are", "Imagine yourself"))
                   for p in v4)
    assert personas >= 30 and sum(p.startswith(("Write", "Draft", "Compose", "Describe", "Come up")) for p in v4) >= 70
    with pytest.raises(BeamtrtError, match="unknown prompt mix"):
        training_prompts(10, mix="v9")


def test_training_prompts_are_the_same_in_every_process():
    """Python's string hashing differs from process to process (PYTHONHASHSEED); reasoning-gym's polynomial
    questions followed it, so a resumed cache or eval_drafter.py's regenerated prompts got other questions."""
    import os
    import subprocess
    import sys

    pytest.importorskip("reasoning_gym")
    code = ("from beamtrt.train.prompts import MIXES, training_prompts; "
            "print(repr([training_prompts(768, 14, mix) for mix in MIXES]))")  # 5 of v3's, 1 of v4's differed
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(runs) == 1 and "Calculate the following" in next(iter(runs))


def test_feature_cache_remembers_its_prompt_mix(target, tmp_path):
    """A cache made before mixes had names is the v1 mix: it resumes under v1 and is refused under v2; other
    settings are named by their flags, each once (the prompt count was named twice, once without its flag). A
    meta.json alone, of a run stopped before its first shard, holds nothing to keep: a run of other settings starts
    it again (it was refused, and only the settings of the run that made nothing would do). --gen-batch, which changes
    no answer, is not one of them unless it changes the shard size."""
    import json

    from beamtrt.train.features import DataRecipe, build_features

    chars = _char_tokenizer(target)
    recipe = DataRecipe(mix="v1", prompts=1, max_new_tokens=2, batch=1, shard_size=1)
    stopped = {"recipe": dataclasses.asdict(DataRecipe(prompts=4, max_new_tokens=8)), "taps": list(TAPS),
               "prompts": 4, "hidden_size": target.cfg.hidden_size}  # a run stopped before its first shard
    (tmp_path / "meta.json").write_text(json.dumps(stopped))
    build_features(target, chars, TAPS, ["hi"], tmp_path, recipe, quiet=True)  # started again, with its settings
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["recipe"] == dataclasses.asdict(recipe) and len(list(tmp_path.glob("features-*"))) == 1
    del meta["recipe"]["mix"]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    build_features(target, chars, TAPS, ["hi"], tmp_path, recipe, quiet=True)
    with pytest.raises(BeamtrtError, match=r"other settings \(--prompt-mix v1 \(now v2\)\): resume it with those"):
        build_features(target, chars, TAPS, ["hi"], tmp_path, dataclasses.replace(recipe, mix="v2"), quiet=True)
    build_features(target, chars, TAPS, ["hi"], tmp_path, dataclasses.replace(recipe, batch=3), quiet=True)  # it
    assert json.loads((tmp_path / "meta.json").read_text())["recipe"]["batch"] == 1  # changes no answer: was refused
    with pytest.raises(BeamtrtError, match=r"\(shard size \(--gen-batch\) 1 \(now 3\)\)"):  # named, not 'remove it'
        build_features(target, chars, TAPS, ["hi"], tmp_path, dataclasses.replace(recipe, batch=3, shard_size=3),
                       quiet=True)
    with pytest.raises(BeamtrtError, match=r"\(--prompts 1 \(now 2\)\): resume"):
        build_features(target, chars, TAPS, ["hi", "yo"], tmp_path, dataclasses.replace(recipe, prompts=2),
                       quiet=True)


def _char_tokenizer(target):
    """A stand-in tokenizer for the tiny target: one id per character of the prompt, no template."""
    return SimpleNamespace(eos_token_id=None, apply_chat_template=lambda messages, add_generation_prompt: [
        ord(c) % (target.cfg.vocab_size - 1) + 1 for c in messages[0]["content"]])


def test_eval_by_kind_finds_each_answers_prompt_kind(target, tmp_path, monkeypatch):
    """scripts/eval_drafter.py's pieces: a cache's sequences get the kinds of the prompts they answer (regenerated
    from its recipe), and each kind scores its last greedy answers exactly as the training eval does."""
    pytest.importorskip("reasoning_gym")
    from beamtrt.train.eval_cli import cache_kinds, evaluate_by_kind
    from beamtrt.train.features import DataRecipe, build_features
    from beamtrt.train.prompts import tagged_prompts

    chars = _char_tokenizer(target)
    recipe = DataRecipe(prompts=12, seed=5, mix="v1", max_new_tokens=6, batch=4, shard_size=8, sampled_every=3)
    tagged = [(p, k) for p, k in tagged_prompts(12, 5, "v1") if len(p) <= recipe.max_prompt_tokens]
    build_features(target, chars, TAPS, [p for p, _ in tagged], tmp_path, recipe, quiet=True)
    data = load_features(tmp_path)
    kinds = cache_kinds(tmp_path, chars, data)
    assert kinds == [k for _, k in tagged] and len(set(kinds)) == 3
    sub = data.select([3, 0])
    assert torch.equal(sub.sequence(0)[0], data.sequence(3)[0]) and torch.equal(sub.sequence(1)[1], data.sequence(0)[1])
    assert sub.greedy.tolist() == [bool(data.greedy[3]), bool(data.greedy[0])]

    drafter = make_drafter(target)
    import tqdm

    steps = []  # the scoring bar steps once per answer scored (once per kind, it stood still for minutes)
    monkeypatch.setattr(tqdm, "tqdm", type("Bar", (tqdm.tqdm,), {"update": lambda self, n=1: steps.append(n)}))
    rows = evaluate_by_kind(drafter, data, kinds, per_kind=2, block=4)
    assert len(steps) == rows["all"]["scored"] > len(set(kinds))
    cfg = TrainConfig(eval_block_size=4)

    def expected(answers: list[int]) -> dict:  # the training eval's ratios, and the decoder's τ: mean over answers
        alone = [evaluate(drafter, data, [i], cfg) for i in answers]
        return {"scored": len(answers), **{key: pytest.approx(sum(a[f"eval_{key}"] for a in alone) / len(alone),
                                                              abs=1e-4) for key in ("tau", "tau_top1")},
                **evaluate(drafter, data, answers, cfg)}

    for kind in set(kinds):
        last = [i for i in range(len(data)) if kinds[i] == kind and bool(data.greedy[i])][-2:]
        assert rows[kind] == expected(last)
    every = [i for i in range(len(data)) if bool(data.greedy[i])
             and sum(kinds[j] == kinds[i] and bool(data.greedy[j]) for j in range(i + 1, len(data))) < 2]
    assert rows["all"] == expected(every)
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(BeamtrtError, match="no readable meta.json"):
        cache_kinds(tmp_path, chars, data)


def test_feature_cache_resumes_with_the_same_shards(target, tmp_path):
    """Shards of 4 answered 3 at a time (answers cross shard boundaries); a shard lost to an interruption is
    answered again, alone, and comes out as it was; every 2nd answer is sampled and flagged as such. From its answers
    files alone, a cache gets the same taps back."""
    from beamtrt.train.features import DataRecipe, build_features, rebuild_features

    chars = _char_tokenizer(target)
    prompts = ["two plus two", "hello", "a haiku on rain", "sort a list", "why", "tcp in one line", "bees", "blue",
               "name a painter", "twelve times seven"]
    recipe = DataRecipe(prompts=len(prompts), max_new_tokens=6, batch=3, shard_size=4, sampled_every=2)
    build_features(target, chars, TAPS, prompts, tmp_path, recipe, quiet=True)
    paths = sorted(tmp_path.glob("features-*.safetensors"))
    assert [p.name for p in paths] == [f"features-0000{i}.safetensors" for i in range(3)]
    whole = load_features(tmp_path)
    assert len(whole) == 10 and whole.greedy.tolist() == [True, False] * 5
    assert whole.prompt_len.tolist() == [len(p) for p in prompts]
    paths[1].unlink()
    (tmp_path / "answers-00001.safetensors").unlink()  # with its answers file: answered again
    build_features(target, chars, TAPS, prompts, tmp_path, recipe, quiet=True)
    again = load_features(tmp_path)
    assert torch.equal(again.ids, whole.ids) and torch.equal(again.seq_start, whole.seq_start)
    torch.testing.assert_close(again.taps, whole.taps)

    # Only the answers files kept (what git holds): the taps come back from a teacher-forced forward
    answers = {p.name: p.read_bytes() for p in tmp_path.glob("answers-*.safetensors")}
    assert sorted(answers) == [f"answers-0000{i}.safetensors" for i in range(3)]
    for p in tmp_path.glob("features-*.safetensors"):
        p.unlink()
    build_features(target, chars, TAPS, prompts, tmp_path, recipe, quiet=True)
    rebuilt = load_features(tmp_path)
    assert torch.equal(rebuilt.ids, whole.ids) and torch.equal(rebuilt.seq_start, whole.seq_start)
    assert torch.equal(rebuilt.prompt_len, whole.prompt_len) and torch.equal(rebuilt.greedy, whole.greedy)
    torch.testing.assert_close(rebuilt.taps, whole.taps)  # bf16: rounding may differ in the last bit
    (tmp_path / "answers-00002.safetensors").unlink()  # caches made before answers files get them
    rebuild_features(target, TAPS, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("answers-*.safetensors")} == answers
    (tmp_path / "features-00000.safetensors").unlink()
    with pytest.raises(BeamtrtError, match="answers made for target layers"):
        rebuild_features(target, TAPS[:-1], tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "hidden_size": 2 * target.cfg.hidden_size}))
    with pytest.raises(BeamtrtError, match=f"hidden size {2 * target.cfg.hidden_size}, this target's is"):
        rebuild_features(target, TAPS, tmp_path)  # checked before anything is read or written
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "answers-00000.safetensors").write_bytes(b"garbage")
    with pytest.raises(BeamtrtError, match="answers-00000.safetensors: corrupt answers file"):
        rebuild_features(target, TAPS, tmp_path)


def test_a_cache_can_leave_out_the_prompts_other_caches_answered(target, tmp_path):
    """answered_prompts reads a cache's prompts (answers files, or feature shards without one); a cache made with
    them skipped answers only the others, records it, and resumes only with the same prompts skipped."""
    from beamtrt.train.features import DataRecipe, answered_prompts, build_features, chat_ids

    chars = _char_tokenizer(target)
    recipe = DataRecipe(max_new_tokens=4, batch=3, shard_size=2, sampled_every=2)
    first, second = ["hello", "why", "bees", "blue"], ["why", "sort a list", "blue", "tcp in one line", "a painter"]
    a, b = tmp_path / "a", tmp_path / "b"
    build_features(target, chars, TAPS, first, a, recipe, quiet=True)
    seen = answered_prompts(a)
    assert seen == {tuple(chat_ids(chars, p)) for p in first}
    (a / "answers-00000.safetensors").unlink()  # a shard without its answers file: read from the shard
    assert answered_prompts(a) == seen
    build_features(target, chars, TAPS, second, b, recipe, quiet=True, skip=seen)
    kept = load_features(b)
    assert [kept.sequence(i)[0][:kept.sequence(i)[2]].tolist() for i in range(len(kept))] == [
        chat_ids(chars, p) for p in ("sort a list", "tcp in one line", "a painter")]
    assert json.loads((b / "meta.json").read_text())["skipped"]["prompts"] == 2
    build_features(target, chars, TAPS, second, b, recipe, quiet=True, skip=seen)  # the same: nothing to do
    for skip, needle in ((None, "made leaving out 2 prompts"), (set(), r"leave out 0 \(other ones\)")):
        with pytest.raises(BeamtrtError, match=needle):
            build_features(target, chars, TAPS, second, b, recipe, quiet=True, skip=skip)
    with pytest.raises(BeamtrtError, match="made without --skip-answered-in"):
        build_features(target, chars, TAPS, first, a, recipe, quiet=True, skip=set())
    with pytest.raises(BeamtrtError, match="every one of the 4 prompts"):
        build_features(target, chars, TAPS, first, tmp_path / "c", recipe, quiet=True, skip=seen)
    assert not (tmp_path / "c").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(BeamtrtError, match="empty: not a feature cache"):
        answered_prompts(tmp_path / "empty")


def test_a_stopped_cache_build_resumes_to_the_same_bytes(target, tmp_path, monkeypatch):
    """Ctrl-C between a shard's two files: the rerun ends with the uninterrupted run's bytes (the answers file came
    first, and its taps were then recomputed, not bit for bit). A damaged shard is named before anything is answered,
    and shards without their meta.json are not adopted under a new one."""
    import beamtrt.train.features as features
    from beamtrt.train.features import DataRecipe, build_features

    chars = _char_tokenizer(target)
    prompts = ["two plus two", "hello", "a haiku on rain", "sort a list", "why", "tcp in one line"]
    recipe = DataRecipe(prompts=len(prompts), max_new_tokens=6, batch=3, shard_size=2, sampled_every=2)
    build_features(target, chars, TAPS, prompts, tmp_path / "whole", recipe, quiet=True)
    save, calls = features._save, []

    def stop_at_the_fourth(tensors, path):  # the second file of the second shard
        calls.append(path)
        if len(calls) == 4:
            raise KeyboardInterrupt
        save(tensors, path)

    monkeypatch.setattr(features, "_save", stop_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        build_features(target, chars, TAPS, prompts, tmp_path / "stopped", recipe, quiet=True)
    monkeypatch.undo()
    assert not list((tmp_path / "stopped").glob("*.tmp"))
    build_features(target, chars, TAPS, prompts, tmp_path / "stopped", recipe, quiet=True)
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "stopped").iterdir())
    for name in files:
        assert (tmp_path / "stopped" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name

    shard = tmp_path / "whole" / "features-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(BeamtrtError, match="features-00001.safetensors: corrupt feature shard .*; remove it: its "
                                           "taps are rebuilt from its answers file"):
        build_features(target, chars, TAPS, prompts, tmp_path / "whole", recipe, quiet=True)
    (tmp_path / "stopped" / "meta.json").unlink()
    with pytest.raises(BeamtrtError, match="holds feature shards but no meta.json"):
        build_features(target, chars, TAPS, prompts, tmp_path / "stopped", recipe, quiet=True)


@pytest.mark.usefixtures("step_path")  # each CPU step path compared with itself
@pytest.mark.parametrize("batch", [None, 2])
def test_batched_answers_with_early_finishers_equal_single_runs(target, batch):
    """Rows that stop early change nothing for the rows still going, and a slot freed by one answer and refilled
    with the next prompt (batch 2 for 4 prompts: continuous batching) answers it as a run of its own would;
    so does a sampled answer, which draws from its own seed."""
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2], [7, 1, 9]]
    sampled = [False, True, False, True]
    free = _answers(target, prompts, 10)
    firsts = {t for ids, _ in free for t in ids[-10:-7]}  # a token that ends some answers early
    eos = next(t for t in sorted(firsts) if sum(t in ids[-10:] for ids, _ in free) < len(prompts))
    order = [i for i, _, _ in answer_with_taps(target, prompts, TAPS, [eos], 10, sampled, seeds=range(4),
                                               temperature=0.7, top_p=0.99, batch=batch)]
    assert sorted(order) == [0, 1, 2, 3]
    batched = _answers(target, prompts, 10, eos_ids=[eos], sampled=sampled, batch=batch)
    assert len({len(ids) - len(p) for (ids, _), p in zip(batched, prompts)}) > 1  # they did finish at different times
    for i, ((ids, taps), p) in enumerate(zip(batched, prompts)):
        alone = answer_with_taps(target, [p], TAPS, [eos], 10, [sampled[i]], seeds=[i], temperature=0.7, top_p=0.99)
        _, alone_ids, alone_taps = next(alone)
        assert ids == alone_ids
        torch.testing.assert_close(taps, alone_taps, rtol=1e-5, atol=1e-5)


def test_init_from_a_saved_drafter(target, tmp_path, capsys):
    """--init: training continues from a checkpoint's weights (trainable, fp32); another layout is refused."""
    from beamtrt.models.dflash2 import save_drafter
    from beamtrt.train.cli import start_from

    saved = make_drafter(target, seed=3)
    def ctrl_c(folder):
        (folder / "train_log.jsonl").write_text("")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # train_drafter.py's log files go in with the weights, or nothing does
        save_drafter(saved, tmp_path / "d", also=ctrl_c)
    assert list(tmp_path.iterdir()) == []
    save_drafter(saved, tmp_path / "d", also=lambda folder: (folder / "training.json").write_text("{}"))
    assert (tmp_path / "d" / "training.json").read_text() == "{}"
    copy = start_from(tmp_path / "d", saved.cfg, target)
    assert copy.dtype == torch.float32 and all(p.requires_grad for p in copy.parameters())
    assert all(torch.equal(a.float(), b) for a, b in zip(saved.state_dict().values(), copy.state_dict().values()))
    for other in ({"num_hidden_layers": saved.cfg.num_hidden_layers - 1}, {"selector_rank": 4}):
        with pytest.raises(BeamtrtError, match=f"layout differs .*{next(iter(other))}"):
            start_from(tmp_path / "d", dataclasses.replace(saved.cfg, **other), target)
    with pytest.raises(BeamtrtError, match=r"a drafter of another target or recipe \(rms_norm_eps differ"):
        start_from(tmp_path / "d", dataclasses.replace(saved.cfg, rms_norm_eps=1e-3), target)  # no flag fixes it
    data = _features(target)  # a run from --init first scores the starting drafter on its held-out set (step 0)
    cfg = dataclasses.replace(TINY_RUN, steps=2, init_from=str(tmp_path / "d"))
    log = train(copy, data, cfg, tmp_path / "w")
    assert [row["step"] for row in log] == [0, 1, 2] and log[0] == {"step": 0, "seconds": 0.0} | evaluate(
        start_from(tmp_path / "d", saved.cfg, target).eval(), data, split(data, cfg)[1], cfg)
    said = capsys.readouterr().err  # each eval is said while it runs (the bar stood still, nothing before step 1)
    assert "step 0: scoring the --init drafter on 2 held-out answers" in said and "step 2: scoring 2 held-out" in said
    assert log[0]["eval_tau"] >= 1.0 and "loss" not in log[0]


def test_init_that_a_stopped_run_left_aside_is_put_back_first(target, tmp_path, capsys):
    """--init X --out X --force killed between staging's two renames: X lies in .X.old-*/x and X is missing. The rerun
    put it back only when writing X, after refusing --init X as not a drafter; it is put back before --init is read."""
    from beamtrt.models.dflash2 import save_drafter
    from beamtrt.train.cli import main

    save_drafter(make_drafter(target), tmp_path / "d" / "x")
    aside = tmp_path / ".out.old-killed"
    (tmp_path / "d").rename(aside)
    out = str(tmp_path / "out")
    assert main(["--init", out, "--out", out, "--force", "--target", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert f"note: put back {out} from {aside}" in err and "--target" in err.splitlines()[-1]  # the next check's line
    assert (tmp_path / "out" / "config.json").is_file() and not aside.exists()


def test_data_only_checks_the_training_flags_as_its_help_says(capsys):
    """--help said phase 2's flags were "accepted and not used" with --data-only, and they are checked."""
    from beamtrt.train.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "phase 2's flags are checked but not used" in " ".join(capsys.readouterr().out.split())
    assert main(["--data-only", "--steps", "0"]) == 2
    assert capsys.readouterr().err == "error: --steps must be >= 1, got 0\n"


def test_init_grows_a_drafter_by_identity_layers(target, tmp_path):
    """--init with a deeper --layers: the checkpoint's layers are kept and new last layers start as the identity, so
    the grown drafter drafts exactly as the checkpoint at step 0; one training step moves the new layers."""
    from beamtrt.models.dflash2 import save_drafter
    from beamtrt.train.cli import start_from

    saved = make_drafter(target, seed=3)
    saved.set_draft_vocab(range(0, target.cfg.vocab_size, 2))
    save_drafter(saved, tmp_path / "d")
    depth = saved.cfg.num_hidden_layers
    grown = start_from(tmp_path / "d", dataclasses.replace(saved.cfg, num_hidden_layers=depth + 2), target, seed=1)
    assert len(grown.layers) == depth + 2 and all(p.requires_grad for p in grown.parameters())
    assert torch.equal(grown.draft_vocab, saved.draft_vocab)  # it drafts from the checkpoint's vocabulary too
    data = _features(target)
    ids, taps = data.sequence(0)[:2]
    anchors = torch.arange(2, ids.shape[0] - 4, 3)
    same = start_from(tmp_path / "d", saved.cfg, target)
    with torch.no_grad():
        for got, want in zip(*(block_forward(d, ids, taps.float(), anchors, 4) for d in (grown, same))):
            assert torch.equal(got, want)  # logits [N, 3, V] and hidden [N, 3, H]
    new = grown.layers[depth].self_attn.o_proj.weight
    assert not new.any()
    train(grown, data, dataclasses.replace(TINY_RUN, steps=1), tmp_path / "w", quiet=True)
    assert new.any()


def test_continuing_with_the_same_seed_on_the_same_data_is_flagged(tmp_path):
    """Anchors of step s come from (seed, s): a run from --init on its drafter's data and seed would replay its
    batches, which train_drafter.py warns about (run 13 did, docs/DRAFTER.md)."""
    import json

    from beamtrt.train.cli import replays_init_batches

    (tmp_path / "training.json").write_text(json.dumps({"train": {"seed": 0}, "data_sequences": 10,
                                                        "data_tokens": 500}))
    assert replays_init_batches(tmp_path, 0, 10, 500)
    assert not replays_init_batches(tmp_path, 1, 10, 500) and not replays_init_batches(tmp_path, 0, 11, 500)
    (tmp_path / "training.json").write_text("{")
    assert not replays_init_batches(tmp_path, 0, 10, 500) and not replays_init_batches(tmp_path / "none", 0, 10, 500)


@pytest.mark.parametrize("field, value", [("prompts", "many"), ("seed", 1.5), ("mix", 3), ("temperature", "hot"),
                                          ("max_new_tokens", True)])
def test_a_cache_description_of_the_wrong_types_is_one_line(tmp_path, field, value):
    """eval_drafter.py made prompts from a damaged meta.json's recipe and failed in a TypeError traceback."""
    from beamtrt.train.features import read_meta

    (tmp_path / "meta.json").write_text(json.dumps({"recipe": {"prompts": 8, "seed": 0, "mix": "v3", field: value}}))
    with pytest.raises(BeamtrtError, match=f"recipe field '{field}' is {value!r}, not a") as info:
        read_meta(tmp_path)
    assert "\n" not in str(info.value)
    (tmp_path / "meta.json").write_text(json.dumps({"recipe": {"prompts": 8, "temperature": 1}}))
    assert read_meta(tmp_path)["recipe"]["temperature"] == 1  # an int where a float is meant is fine


@pytest.mark.parametrize("prompts", [10**12, 1_000_001, 0, -5])
def test_a_cache_description_of_more_prompts_than_a_run_makes_is_one_line(tmp_path, prompts):
    """eval_drafter.py makes a cache's prompts again from its recipe: 10**12 of them ran silently for hours."""
    from beamtrt.train.features import read_meta

    (tmp_path / "meta.json").write_text(json.dumps({"recipe": {"prompts": prompts, "seed": 0}}))
    with pytest.raises(BeamtrtError, match=f"recipe field 'prompts' is {prompts}, outside 1 to 1,000,000 "):
        read_meta(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"recipe": {"prompts": 1_000_000, "seed": 0}}))
    assert read_meta(tmp_path)["recipe"]["prompts"] == 1_000_000


def test_the_training_log_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """--work's train_log.jsonl: an interrupted write leaves the previous log, not a cut one, and no temporary file."""
    import os

    from beamtrt.train.trainer import write_log

    path = tmp_path / "train_log.jsonl"
    write_log(path, [{"step": 1}])

    def interrupted(fd):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_log(path, [{"step": 1}, {"step": 2}])
    assert path.read_text() == '{"step": 1}\n' and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_complete_cache_shows_no_answers_bar(target, tmp_path, capsys):
    """A rerun on a cache whose shards are all answered printed an empty 'target answers' bar at 100%."""
    from beamtrt.train.features import DataRecipe, build_features

    recipe = DataRecipe(prompts=1, max_new_tokens=2, batch=1, shard_size=1)
    build_features(target, _char_tokenizer(target), TAPS, ["hi"], tmp_path, recipe)
    assert "target answers" in capsys.readouterr().err
    build_features(target, _char_tokenizer(target), TAPS, ["hi"], tmp_path, recipe)
    assert "target answers" not in capsys.readouterr().err


def test_the_loss_pieces_are_the_recipes_by_hand():
    """block_labels, decay_weights and eval_ratios against hand-worked values (a label past the sequence's end, a
    growing decay, and the top-1 and every-anchor τ over the wrong counts each survived the other tests)."""
    from beamtrt.train.trainer import IGNORE, decay_weights, eval_ratios

    labels = block_labels(torch.tensor([10, 11, 12, 13]), torch.tensor([0, 2]), 4)
    assert labels.tolist() == [[11, 12, 13], [13, IGNORE, IGNORE]]
    torch.testing.assert_close(decay_weights(4, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))
    sums = {"steps": 4.0, "steps_top1": 5.0, "tokens": 10.0, "every": 30.0, "recall": 3.0, "count": 6.0}
    assert eval_ratios(sums) == {"eval_tau": 2.5, "eval_tau_top1": 2.0, "eval_tau_every_anchor": 3.0,
                                 "eval_recall": 0.5}


def test_a_logged_step_is_the_weighted_means_of_its_blocks(target, tmp_path):
    """Step 1's logged loss terms and accuracy, from the blocks it drew scored by the drafter it started from: the
    CE and the KL over the CE's weights, the selector's CE over its own (the recalled slots'), the accuracy over the
    valid slots (a wrong denominator in any of them survived the other tests)."""
    import copy

    from beamtrt.train.trainer import draw

    data, drafter = _features(target), make_drafter(target, seed=1, selector_top_k=32)  # recalls some labels
    before = copy.deepcopy(drafter).train()
    cfg = dataclasses.replace(TINY_RUN, steps=1, distill=0.5, eval_sequences=0, seqs_per_step=4, anchors_per_seq=8,
                              block_size=16)
    row = train(drafter, data, cfg, tmp_path / "w", quiet=True)[-1]
    parts = [block_losses(before, *data.sequence(i)[:2], anchors, cfg)
             for i, anchors in draw(data, split(data, cfg)[0], cfg, 0)]
    t = {k: float(sum(p[k] for p in parts).detach()) for k in parts[0]}
    base, sel, kd = t["base"] / t["base_w"], t["sel"] / t["sel_w"], t["kd"] / t["base_w"]
    assert t["count"] > t["recalled"] > 0 and t["base_w"] > t["sel_w"]  # the denominators differ here
    want = {"loss": base + cfg.selector_weight * sel + 0.5 * kd, "base": base, "selector": sel, "kd": kd,
            "acc": t["correct"] / t["count"], "recall": t["recalled"] / t["count"]}
    assert {k: row[k] for k in want} == pytest.approx(want, abs=2e-4), (row, want)
