"""Run under mpirun by tests/test_mpi.py: every rank loads its shard of the build's target (CKPT) and drafter (its
sibling `drafter`); rank 0 checks that every rank computed bit-identical replicated results (the target's logits and
taps, the drafter's draft logits, hidden states, candidates and selector scores: dist.py's collectives promise it, and
a rank whose residual stream drifted would route, draft and commit differently; the taps and hidden states show a
drift, as gathered logits cannot: each rank's vocabulary rows come from its own stream, the same concatenation
everywhere), then compares the fp32 logits of a batch, and the drafter's draft logits and candidates after a context
append, with the un-sharded models and prints the max relative differences."""

import hashlib
import sys
from pathlib import Path

import torch

from beamtrt.checkpoint.trtllm_files import load_drafter_checkpoint, load_target
from beamtrt.runtime import tp
from beamtrt.runtime.dist import Dist


def digests(**tensors: torch.Tensor | None) -> dict[str, str]:
    """sha256 of each tensor's dtype, shape and bytes (None: not computed, left out)."""
    return {name: hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode() + t.contiguous().numpy().tobytes()).hexdigest()
            for name, t in tensors.items() if t is not None}


dist = Dist.create()
model = tp.load_target_shard(sys.argv[1], dist)
gen = torch.Generator().manual_seed(0)
ids = torch.randint(0, model.shard.vocab_size, (3, 11), generator=gen)
drafter_dir = Path(sys.argv[1]).parent / "drafter"
drafter = tp.load_drafter_shard(drafter_dir, model, dist)
target_out = model(ids, model.new_cache(3, 16), taps=drafter.cfg.target_layer_ids)
logits = target_out.logits
taps = torch.randn(3, 11, drafter.fc.in_features, generator=gen)
anchors = torch.randint(0, model.shard.vocab_size, (3,), generator=gen)


def draft(d):
    cache = d.new_cache(3)
    d.append_context(cache, taps, torch.tensor([11, 4, 7]))
    return d.draft(cache, anchors, 4)


out = draft(drafter)
mine = digests(logits=logits, **{f"tap{layer}": t for layer, t in zip(drafter.cfg.target_layer_ids, target_out.taps)},
               draft_logits=out.logits, draft_hidden=out.hidden, cand_ids=out.cand_ids, scores=out.scores)
every = dist.gather(mine)
if dist.rank == 0:
    differ = {name: [r for r, theirs in enumerate(every) if theirs.get(name) != digest]
              for name, digest in mine.items()}
    differ = {name: ranks for name, ranks in differ.items() if ranks}
    assert not differ, "not bit-identical on every rank: " + "; ".join(
        f"{name} of rank(s) {', '.join(map(str, ranks))} differ from rank 0's" for name, ranks in differ.items())
    print(f"bit-identical on {dist.size} ranks: {', '.join(mine)}")
    ref = load_target(sys.argv[1])
    want = ref(ids, ref.new_cache(3, 16)).logits
    print(f"max relative logit difference {float((logits - want).abs().max() / want.abs().max()):.3e}")
    ref_out = draft(load_drafter_checkpoint(drafter_dir, ref))
    seen = torch.isfinite(ref_out.logits)  # the draft vocabulary's columns, when the drafter has one
    assert torch.equal(seen, torch.isfinite(out.logits)) and torch.equal(out.cand_ids, ref_out.cand_ids)
    print(f"drafted from {int(seen[0, 0].sum())} tokens, max relative draft logit difference "
          f"{float((out.logits[seen] - ref_out.logits[seen]).abs().max() / ref_out.logits[seen].abs().max()):.3e}")
