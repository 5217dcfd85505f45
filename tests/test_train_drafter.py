"""Drafter training: the training forward is the serving forward, feature capture is exact, resume is exact."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from beamtrt.errors import BeamtrtError
from beamtrt.runtime.generate import generate
from beamtrt.train.features import FeatureSet, answer_with_taps, load_features
from beamtrt.train.trainer import TrainConfig, block_forward, block_labels, train
from conftest import tiny_model
from test_dflash2 import TAPS, make_drafter


@pytest.fixture(scope="module")
def target(one_thread):
    return tiny_model().requires_grad_(False)


def _features(target, n: int = 6, seed: int = 0, max_new: int = 12) -> FeatureSet:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, target.cfg.vocab_size, (int(torch.randint(3, 9, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(n)]
    seqs = answer_with_taps(target, prompts, TAPS, eos_ids=[], max_new_tokens=max_new,
                            sampled=[i % 3 == 2 for i in range(n)], temperature=0.7, top_p=0.99, gen=gen)
    lengths = torch.tensor([len(ids) for ids, _ in seqs])
    return FeatureSet(ids=torch.tensor([t for ids, _ in seqs for t in ids]),
                      taps=torch.cat([f for _, f in seqs]).to(torch.bfloat16),
                      seq_start=torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))),
                      prompt_len=torch.tensor([len(p) for p in prompts]),
                      greedy=torch.tensor([i % 3 != 2 for i in range(n)]))


def test_captured_taps_equal_a_full_forward(target):
    """Taps gathered token by token while answering equal one forward over the finished sequence; greedy answers
    equal plain greedy decoding."""
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2]]
    got = answer_with_taps(target, prompts, TAPS, eos_ids=[], max_new_tokens=7, sampled=[False] * 3,
                           temperature=1.0, top_p=1.0, gen=torch.Generator())
    assert [ids[len(p):] for (ids, _), p in zip(got, prompts)] == generate(target, prompts, 7)
    for ids, taps in got:
        cache = target.new_cache(1, len(ids))
        full = torch.cat(target(torch.tensor([ids]), cache, taps=TAPS).taps, dim=-1)[0]
        assert taps.shape == full.shape
        torch.testing.assert_close(taps, full, rtol=1e-5, atol=1e-5)


def test_answers_stop_at_eos(target):
    got = answer_with_taps(target, [[5, 9, 2, 7]], TAPS, eos_ids=[], max_new_tokens=6, sampled=[False],
                           temperature=1.0, top_p=1.0, gen=torch.Generator())
    eos = got[0][0][6]  # the third answer token becomes the EOS: the answer must end there, EOS kept
    ids, taps = answer_with_taps(target, [[5, 9, 2, 7]], TAPS, eos_ids=[eos], max_new_tokens=6, sampled=[False],
                                 temperature=1.0, top_p=1.0, gen=torch.Generator())[0]
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


TINY_RUN = TrainConfig(steps=6, seqs_per_step=2, anchors_per_seq=4, block_size=8, eval_block_size=4, lr=3e-3,
                       eval_every=3, checkpoint_every=2, eval_sequences=2, eval_anchors=3)


def test_resume_repeats_the_uninterrupted_run(target, tmp_path):
    data = _features(target)
    whole = train(make_drafter(target), data, TINY_RUN, tmp_path / "a", quiet=True)
    interrupted = make_drafter(target)
    first = train(interrupted, data, TINY_RUN, tmp_path / "b", quiet=True, stop_after=3)
    assert len(first) == 3
    resumed = train(make_drafter(target, seed=9), data, TINY_RUN, tmp_path / "b", quiet=True)  # weights from disk
    strip = [{k: v for k, v in row.items() if k != "seconds"} for row in whole]
    assert [{k: v for k, v in row.items() if k != "seconds"} for row in resumed] == strip
    assert any("eval_tau" in row for row in whole) and whole[-1]["loss"] < whole[0]["loss"]


def test_resume_refuses_other_settings_and_corrupt_state(target, tmp_path):
    data = _features(target)
    train(make_drafter(target), data, TINY_RUN, tmp_path, quiet=True, stop_after=2)
    with pytest.raises(BeamtrtError, match="other training settings"):
        train(make_drafter(target), data, dataclasses.replace(TINY_RUN, lr=1e-3), tmp_path, quiet=True)
    with pytest.raises(BeamtrtError, match="other data"):  # more (or other) feature caches than the run began with
        train(make_drafter(target), _features(target, n=7), TINY_RUN, tmp_path, quiet=True)
    (tmp_path / "train_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(BeamtrtError, match="corrupt"):
        train(make_drafter(target), data, TINY_RUN, tmp_path, quiet=True)


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
    (tmp_path / "meta.json").write_text('{"taps": [1, 2]}')
    (other / "meta.json").write_text('{"taps": [0, 2]}')
    with pytest.raises(BeamtrtError, match="target layers"):
        load_features(tmp_path, other)
    (tmp_path / "features-00001.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(BeamtrtError, match="corrupt feature shard"):
        load_features(tmp_path)
    with pytest.raises(BeamtrtError, match="no feature shards"):
        load_features(tmp_path / "missing")


def test_training_prompts_are_deterministic_and_not_benchmarks():
    pytest.importorskip("reasoning_gym")
    from beamtrt.train.prompts import BOXED, CODE_PREFIX, GYM_TASKS, training_prompts

    for mix in ("v1", "v2"):
        a, b = training_prompts(60, seed=3, mix=mix), training_prompts(60, seed=3, mix=mix)
        assert a == b and len(set(a)) == len(a) and len(a) >= 50
        assert training_prompts(60, seed=4, mix=mix) != a
    assert "gsm_symbolic" not in GYM_TASKS
    v2 = training_prompts(200, seed=0)  # v2 is the default
    assert any(p.endswith(BOXED) for p in v2) and not any(p.endswith(BOXED) for p in training_prompts(200, 0, "v1"))
    assert any(p.startswith(CODE_PREFIX + "def ") and '"""' in p for p in v2)  # HumanEval-style stubs
    assert any("Continue this story" in p or "following passage" in p for p in v2)
    with pytest.raises(BeamtrtError, match="unknown prompt mix"):
        training_prompts(10, mix="v3")


def test_feature_cache_remembers_its_prompt_mix(target, tmp_path):
    """A cache made before mixes had names is the v1 mix: it resumes under v1 and is refused under v2."""
    import json

    from beamtrt.train.features import DataRecipe, build_features

    old = {"recipe": {k: v for k, v in dataclasses.asdict(DataRecipe(mix="v1")).items() if k != "mix"},
           "taps": list(TAPS), "prompts": 0, "hidden_size": target.cfg.hidden_size}
    (tmp_path / "meta.json").write_text(json.dumps(old))
    no_prompts = SimpleNamespace(eos_token_id=None)  # no prompt is encoded: only the cache's settings are checked
    build_features(target, no_prompts, TAPS, [], tmp_path, DataRecipe(mix="v1"), quiet=True)
    with pytest.raises(BeamtrtError, match="other settings"):
        build_features(target, no_prompts, TAPS, [], tmp_path, DataRecipe(), quiet=True)


@pytest.mark.usefixtures("step_path")  # each CPU step path compared with itself
def test_batched_answers_with_early_finishers_equal_single_runs(target):
    """Rows that stop early (and the cache compaction that follows) change nothing for the rows still going."""
    prompts = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2], [7, 1, 9]]
    free = answer_with_taps(target, prompts, TAPS, eos_ids=[], max_new_tokens=10, sampled=[False] * 4,
                            temperature=1.0, top_p=1.0, gen=torch.Generator())
    firsts = {t for ids, _ in free for t in ids[-10:-7]}  # a token that ends some answers early
    eos = next(t for t in sorted(firsts) if sum(t in ids[-10:] for ids, _ in free) < len(prompts))
    batched = answer_with_taps(target, prompts, TAPS, eos_ids=[eos], max_new_tokens=10, sampled=[False] * 4,
                               temperature=1.0, top_p=1.0, gen=torch.Generator())
    assert len({len(ids) - len(p) for (ids, _), p in zip(batched, prompts)}) > 1  # they did finish at different times
    for (ids, taps), p in zip(batched, prompts):
        alone_ids, alone_taps = answer_with_taps(target, [p], TAPS, eos_ids=[eos], max_new_tokens=10, sampled=[False],
                                                 temperature=1.0, top_p=1.0, gen=torch.Generator())[0]
        assert ids == alone_ids
        torch.testing.assert_close(taps, alone_taps, rtol=1e-5, atol=1e-5)


def test_init_from_a_saved_drafter(target, tmp_path):
    """--init: training continues from a checkpoint's weights (trainable, fp32); another layout is refused."""
    from beamtrt.models.dflash2 import save_drafter
    from beamtrt.train.cli import start_from

    saved = make_drafter(target, seed=3)
    save_drafter(saved, tmp_path / "d")
    copy = start_from(tmp_path / "d", saved.cfg, target)
    assert copy.dtype == torch.float32 and all(p.requires_grad for p in copy.parameters())
    assert all(torch.equal(a.float(), b) for a, b in zip(saved.state_dict().values(), copy.state_dict().values()))
    with pytest.raises(BeamtrtError, match="layout differs .*num_hidden_layers"):
        start_from(tmp_path / "d", dataclasses.replace(saved.cfg, num_hidden_layers=saved.cfg.num_hidden_layers + 1),
                   target)
