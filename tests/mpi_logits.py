"""Run under mpirun by tests/test_mpi.py: every rank loads its shard of the build's target (CKPT) and drafter (its
sibling `drafter`); rank 0 compares the fp32 logits of a batch, and the drafter's draft logits and candidates after a
context append, with the un-sharded models and prints the max relative differences."""

import sys
from pathlib import Path

import torch

from beamtrt.checkpoint.trtllm_files import load_drafter_checkpoint, load_target
from beamtrt.runtime import tp
from beamtrt.runtime.dist import Dist

dist = Dist.create()
model = tp.load_target_shard(sys.argv[1], dist)
gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, model.shard.vocab_size, (3, 11), generator=gen)
logits = model(ids, model.new_cache(3, 16)).logits
drafter_dir = Path(sys.argv[1]).parent / "drafter"
drafter = tp.load_drafter_shard(drafter_dir, model, dist)
taps = torch.randn(3, 11, drafter.fc.in_features, generator=gen)
anchors = torch.randint(0, model.shard.vocab_size, (3,), generator=gen)


def draft(d):
    cache = d.new_cache(3)
    d.append_context(cache, taps, torch.tensor([11, 4, 7]))
    return d.draft(cache, anchors, 4)


out = draft(drafter)
if dist.rank == 0:
    ref = load_target(sys.argv[1])
    want = ref(ids, ref.new_cache(3, 16)).logits
    print(f"max relative logit difference {float((logits - want).abs().max() / want.abs().max()):.3e}")
    ref_out = draft(load_drafter_checkpoint(drafter_dir, ref))
    seen = torch.isfinite(ref_out.logits)  # the draft vocabulary's columns, when the drafter has one
    assert torch.equal(seen, torch.isfinite(out.logits)) and torch.equal(out.cand_ids, ref_out.cand_ids)
    print(f"drafted from {int(seen[0, 0].sum())} tokens, max relative draft logit difference "
          f"{float((out.logits[seen] - ref_out.logits[seen]).abs().max() / ref_out.logits[seen].abs().max()):.3e}")
