"""The `trt` backend: TensorRT-LLM 1.2 engines behind the backend interface (TensorRT imported only when used).

The target engine is a forward function: every call is a context chunk (paged context FMHA) over the slot's
cached prefix, which is how TensorRT-LLM itself verifies external draft tokens; logits are gathered at the rows
asked for (`last_token_ids`) and the taps come out as extra engine outputs. Rejected rows are rolled back by
shortening the slot's length: their KV entries are overwritten by the next chunk. The drafter engine appends the
pending context and drafts one block per step (beamtrt.build.drafter_net). Acceptance stays in `beamtrt.spec`.
Every TensorRT / TensorRT-LLM call here is listed in docs/trtllm-api.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from beamtrt.build.engine import ENGINE_DIR, TAP_OUTPUT, EngineError
from beamtrt.runtime.backend import DraftStep, TargetStep
from beamtrt.spec.sampling import SamplingParams
from beamtrt.spec.selector import draft_confidence

CONTEXT_CHUNK = 512  # drafter context rows appended per engine call (longer prompts take several calls)


class _Engine:
    """One rank's engine in a TensorRT-LLM Session, with its I/O table (name -> on host?, dtype)."""

    def __init__(self, path: Path):
        import tensorrt as trt
        from tensorrt_llm._utils import trt_dtype_to_torch
        from tensorrt_llm.runtime import Session

        if not path.is_file():
            raise EngineError(f"{path}: engine missing (rebuild with build/build_engines.py)")
        self.session = Session.from_serialized_engine(path.read_bytes())
        engine = self.session.engine
        self.io = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            # TensorRT-LLM declares every input DEVICE at build time; its plugins read the host_* inputs and the
            # all-reduce workspace (a pointer table) from host memory, so those are fed from the CPU by name
            host = name.startswith("host_") or name == "all_reduce_workspace" or (
                engine.get_tensor_location(name) == trt.TensorLocation.HOST)
            self.io[name] = (engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT, host,
                             trt_dtype_to_torch(engine.get_tensor_dtype(name)))
        self.inputs = [n for n, (is_input, _, _) in self.io.items() if is_input]

    def tensor(self, name: str, value) -> torch.Tensor:
        """`value` as the engine's input `name` wants it: its dtype, on the host or the GPU."""
        _, host, dtype = self.io[name]
        t = torch.as_tensor(value).to(dtype)
        return t.contiguous() if host else t.cuda().contiguous()

    def run(self, feeds: dict, outputs: dict | None = None) -> dict:
        """Run with `feeds` (every engine input; values converted by `tensor`); outputs allocated here unless
        given (aliased ring outputs are given)."""
        from tensorrt_llm.runtime.session import TensorInfo

        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise EngineError(f"the engine wants input {missing[0]!r}, which beamtrt does not provide "
                              "(an engine built by another TensorRT-LLM version?)")
        inputs = {n: self.tensor(n, v) for n, v in feeds.items() if n in self.io}
        infos = [TensorInfo(n, _trt_dtype(t.dtype), tuple(t.shape)) for n, t in inputs.items()]
        shapes = {o.name: tuple(o.shape) for o in self.session.infer_shapes(infos)}
        outs = dict(outputs or {})
        for name, shape in shapes.items():
            if name not in outs:
                outs[name] = torch.empty(shape, dtype=self.io[name][2], device="cuda")
        stream = torch.cuda.current_stream()
        if not self.session.run(inputs, outs, stream.cuda_stream):
            raise EngineError("TensorRT could not enqueue the engine (see its log)")
        stream.synchronize()
        return outs


def all_reduce_workspace(tp: int, rank: int):
    """(IPC buffers to keep alive, the int64 pointer table fed as `all_reduce_workspace`) for tp > 1, as TensorRT-LLM's
    own runtime allocates them; (None, None) for one rank."""
    if tp == 1:
        return None, None
    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.plugin.plugin import CustomAllReduceHelper

    mapping = Mapping(world_size=tp, rank=rank, tp_size=tp)
    return CustomAllReduceHelper.allocate_workspace(mapping, CustomAllReduceHelper.max_workspace_size_auto(tp))


def pack(ids: torch.Tensor, num: torch.Tensor, past: torch.Tensor, last_only: bool) -> dict[str, torch.Tensor]:
    """The token inputs of one target step with removed padding: every request is a context chunk of num[n] tokens
    after past[n] cached ones. ids [N, T] right-padded, num and past [N] -> input_ids and position_ids [sum(num)],
    last_token_ids (1-based packed rows whose logits the engine gathers: each request's last, or all of them),
    context / sequence / past-KV lengths [N]."""
    N, T = ids.shape
    valid = torch.arange(T)[None, :] < num[:, None]  # [N, T]
    ends = num.cumsum(0)  # 1-based packed index of each request's last token
    rows = ends.view(N, 1) - num.view(N, 1) + torch.arange(1, T + 1).view(1, T)  # [N, T]
    return {"input_ids": ids[valid], "position_ids": (past[:, None] + torch.arange(T)[None, :])[valid],
            "last_token_ids": ends if last_only else rows[valid], "context_lengths": num,
            "host_context_lengths": num, "sequence_length": past + num, "host_past_key_value_lengths": past + num}


def check_batch(slots: int, max_batch_size: int, engine: str) -> None:
    """An engine runs at most its build's --max-batch-size requests at once."""
    if slots > max_batch_size:
        raise EngineError(f"{slots} requests at once exceed the {engine} engine's --max-batch-size {max_batch_size}: "
                          f"decode at most {max_batch_size} at once (run.py --concurrency, the Triton export's "
                          "--max-slots) or rebuild with a larger one")


def _trt_dtype(dtype: torch.dtype):
    from tensorrt_llm._utils import torch_dtype_to_trt

    return torch_dtype_to_trt(dtype)


class TrtTarget:
    """The target engine of one rank, with a paged KV cache laid out statically: slot s owns blocks
    [s * M, (s + 1) * M) of one pool [blocks, layers, 2, tokens_per_block * kv_heads * head_size]."""

    def __init__(self, root: Path, manifest: dict, rank: int):
        engine_dir = root / manifest["target"]["dir"] / ENGINE_DIR
        config = json.loads((engine_dir / "config.json").read_text())
        pretrained, build = config["pretrained_config"], config["build_config"]
        self.engine = _Engine(engine_dir / f"rank{rank}.engine")
        self.vocab_size = pretrained["vocab_size"]
        eos = pretrained.get("beam_config", {}).get("eos_token_id")
        self.eos_token_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        tp = pretrained["mapping"]["tp_size"]
        self.layers = pretrained["num_hidden_layers"]
        self.kv_heads = -(-pretrained["num_key_value_heads"] // tp)  # TensorRT-LLM duplicates heads below tp
        self.head_size = pretrained["head_size"]
        self.tokens_per_block = build["plugin_config"]["tokens_per_block"]
        self.max_seq_len = build["max_seq_len"]
        self.max_batch_size = build["max_batch_size"]  # requests decoded at once (the decoder keeps to it)
        kv_fp8 = (pretrained.get("quantization") or {}).get("kv_cache_quant_algo") == "FP8"
        self.kv_dtype = torch.float8_e4m3fn if kv_fp8 else {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                                            "float32": torch.float32}[pretrained["dtype"]]
        if not build["plugin_config"].get("use_paged_context_fmha"):
            raise EngineError(f"{engine_dir}: built without paged context FMHA (TensorRT-LLM turns it off for some "
                              "KV-cache settings); the trt backend verifies blocks as context chunks and needs it")
        self.max_num_tokens = build["max_num_tokens"]
        self._ipc, self.workspace = all_reduce_workspace(tp, rank)

    def allocate(self, slots: int, max_len: int) -> None:
        check_batch(slots, self.max_batch_size, "target")
        if max_len > self.max_seq_len:
            raise EngineError(f"requests of up to {max_len} tokens exceed the engine's --max-seq-len "
                              f"{self.max_seq_len}")
        per_seq = math.ceil(max_len / self.tokens_per_block)
        block = self.tokens_per_block * self.kv_heads * self.head_size
        self.pool = torch.zeros(slots * per_seq, self.layers, 2, block, dtype=self.kv_dtype, device="cuda")
        blocks = torch.arange(slots * per_seq, dtype=torch.int32).view(slots, 1, per_seq)
        kv = torch.arange(2, dtype=torch.int32).view(1, 2, 1)
        self.offsets = (blocks * self.layers * 2 + kv).unsqueeze(0)  # [1 pool, slots, 2, per_seq]
        self.capacity = max_len
        self.lengths = torch.zeros(slots, dtype=torch.long)

    def forward(self, ids: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor | None = None,
                taps: tuple[int, ...] = (), last_only: bool = False) -> TargetStep:
        # ids: [N, T] right-padded (packed on the host: a few ids, the drafts may come from the GPU); slots: [N];
        # num_tokens: [N] (default T)
        ids = ids.cpu()
        N, T = ids.shape
        num = torch.full((N,), T, dtype=torch.long) if num_tokens is None else num_tokens.long().cpu()
        if int(num.sum()) <= self.max_num_tokens:
            return self._forward(ids, slots.cpu(), num, taps, last_only)
        if not last_only:
            raise EngineError(f"a step of {int(num.sum())} tokens exceeds the engine's --max-num-tokens "
                              f"{self.max_num_tokens}")
        # a long prefill: column chunks, each request's last chunk gives its logits (chunked context)
        width = max(1, self.max_num_tokens // N)
        logits, tapped = None, None
        for begin in range(0, T, width):
            count = (num - begin).clamp(0, width)
            rows = count.nonzero().flatten()
            step = self._forward(ids[rows, begin:begin + width], slots.cpu()[rows], count[rows], taps, True)
            if logits is None:
                logits = step.logits.new_zeros(N, 1, step.logits.shape[-1])
                tapped = None if step.taps is None else step.taps.new_zeros(N, T, step.taps.shape[-1])
            on_gpu = rows.to(step.logits.device)
            logits[on_gpu] = step.logits
            if tapped is not None:
                tapped[on_gpu, begin:begin + step.taps.shape[1]] = step.taps
        return TargetStep(logits, tapped)

    def _forward(self, ids: torch.Tensor, slots: torch.Tensor, num: torch.Tensor, taps: tuple[int, ...],
                 last_only: bool) -> TargetStep:
        N, T = ids.shape
        past = self.lengths[slots]
        if bool((past + num > self.capacity).any()):
            raise EngineError(f"a request outgrew its KV cache of {self.capacity} tokens")
        valid = torch.arange(T)[None, :] < num[:, None]  # [N, T]
        feeds = {
            **pack(ids, num, past, last_only),
            "host_request_types": torch.zeros(N), "cache_indirection": torch.zeros(N, 1, self.capacity),
            "kv_cache_block_offsets": self.offsets[:, slots], "host_kv_cache_block_offsets": self.offsets[:, slots],
            "host_kv_cache_pool_pointers": torch.tensor([[self.pool.data_ptr(), 0]]),
            "host_kv_cache_pool_mapping": torch.tensor([[0, layer] for layer in range(self.layers)]),
            "host_max_attention_window_sizes": torch.full((self.layers,), self.capacity),
            "host_sink_token_length": torch.zeros(1), "host_runtime_perf_knobs": torch.full((16,), -1),
            "host_context_progress": torch.zeros(1),
        }
        if self.workspace is not None:
            feeds["all_reduce_workspace"] = self.workspace
        out = self.engine.run(feeds)
        self.lengths[slots] = past + num
        logits = out["logits"].float()[:, :self.vocab_size]  # [rows asked for, V], left on the GPU (verified there)
        valid = valid.to(logits.device)
        if last_only:
            full = logits.view(N, 1, -1)
        else:
            full = logits.new_zeros(N, T, logits.shape[-1])
            full[valid] = logits
        tapped = None
        if taps:
            missing = [i for i in taps if TAP_OUTPUT.format(i) not in out]
            if missing:
                raise EngineError(f"the target engine has no output for tapped layer {missing[0]} (rebuild it "
                                  "with this drafter)")
            packed = torch.cat([out[TAP_OUTPUT.format(i)] for i in taps], dim=-1)  # [tokens, n_taps * H], GPU
            tapped = packed.new_zeros(N, T, packed.shape[-1])
            tapped[valid] = packed
        return TargetStep(full, tapped)

    def crop(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        self.lengths[slots.cpu()] = lengths.long().cpu()  # rows past the length are overwritten by the next chunk

    def reset(self, slots: list[int]) -> None:
        self.lengths[slots] = 0


class TrtDrafter:
    """The drafter engine of one rank: per-layer context rings as engine I/O, pending context appended with the
    next draft (in chunks of CONTEXT_CHUNK rows). Every call runs all slots (idle ones append nothing and their
    drafts are dropped), so the rings are never gathered or scattered."""

    def __init__(self, root: Path, manifest: dict, rank: int):
        from beamtrt.build.drafter_net import NetConfig
        from beamtrt.config import DrafterConfig
        from beamtrt.models.beam import Rotary

        engine_dir = root / manifest["drafter"]["dir"] / ENGINE_DIR
        self.cfg = NetConfig(**json.loads((engine_dir / "config.json").read_text()))
        self.engine = _Engine(engine_dir / f"rank{rank}.engine")
        checkpoint = json.loads((root / manifest["drafter"]["dir"] / "config.json").read_text())
        drafter_cfg = DrafterConfig.from_dict(checkpoint["drafter_config"])
        self.target_layer_ids = tuple(drafter_cfg.target_layer_ids)
        self.block_size = self.cfg.block_size  # the engine's block (draft() takes only that one)
        self.rotary = Rotary(drafter_cfg)
        self.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[self.cfg.dtype]
        self._ipc, self.workspace = all_reduce_workspace(self.cfg.tp_size, rank)

    def allocate(self, slots: int) -> None:
        c = self.cfg
        check_batch(slots, c.max_batch_size, "drafter")
        shape = (slots, c.local_kv_heads, c.window, c.head_dim)
        self.rings = [(torch.zeros(shape, dtype=self.dtype, device="cuda"),
                       torch.zeros(shape, dtype=self.dtype, device="cuda")) for _ in range(c.num_layers)]
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.pending: list[list[torch.Tensor]] = [[] for _ in range(slots)]  # per slot: committed rows' taps

    def append_context(self, taps: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        # taps: [N, T, n_taps * H] right-padded; slots, num_tokens: [N]
        for row, (s, n) in enumerate(zip(slots.tolist(), num_tokens.tolist())):
            if n:
                self.pending[s].append(taps[row, :n])

    def draft(self, anchor_ids: torch.Tensor, block_size: int, slots: torch.Tensor, params: SamplingParams,
              uniforms: torch.Tensor | None) -> DraftStep:
        c = self.cfg
        if block_size != c.block_size:
            raise EngineError(f"the drafter engine was built for block {c.block_size}; run with --block-size "
                              f"{c.block_size} (or rebuild with build_engines.py --block-size {block_size})")
        skipped, chunks = context_chunks(self.pending, c.window, CONTEXT_CHUNK)
        self.lengths += skipped
        self.pending = [[] for _ in self.pending]
        for rows, counts in chunks:  # the last chunk's call drafts; earlier calls only append (drafts unused)
            out = self._step(rows, counts, anchor_ids, slots, params, uniforms)
        pick = slots.cuda()  # the outputs stay on the GPU, where the decoder verifies
        drafts, cand = out["draft_ids"].long()[pick], out["cand_ids"].long()[pick]
        q = out["q"].float()[pick]  # greedy requests: the temperature-1 rows, for the confidence only
        return DraftStep(drafts, cand, None if params.greedy else q, draft_confidence(q))

    def _step(self, rows: list, counts: torch.Tensor, anchor_ids, slots, params: SamplingParams, uniforms) -> dict:
        c, n = self.cfg, len(rows)
        C = max(1, int(counts.max()))
        taps = torch.zeros(n, C, c.num_taps * c.target_hidden_size, dtype=self.dtype, device="cuda")
        for s, r in enumerate(rows):
            if counts[s]:
                taps[s, :counts[s]] = r.to(self.dtype)
        start = self.lengths.clone()
        ctx_cos, ctx_sin = self.rotary(start[:, None] + torch.arange(C)[None, :], self.dtype)
        anchor_at = start + counts  # the anchor's position: right after the context it sees
        block_cos, block_sin = self.rotary(anchor_at[:, None] + torch.arange(c.block_size)[None, :], self.dtype)
        anchors = torch.zeros(n, dtype=torch.long)
        anchors[slots.cpu()] = anchor_ids.cpu().long()
        u = torch.zeros(n, c.block_size - 1)
        if uniforms is not None:
            u[slots.cpu()] = uniforms.float()
        feeds = {"anchor_ids": anchors, "ctx_taps": taps, "ctx_start": start, "ctx_count": counts,
                 "ctx_cos": ctx_cos, "ctx_sin": ctx_sin, "block_cos": block_cos, "block_sin": block_sin,
                 "temperature": torch.full((n,), params.temperature), "top_p": torch.full((n,), params.top_p),
                 "uniforms": u}
        if self.workspace is not None:
            feeds["all_reduce_workspace"] = self.workspace
        rings = {}
        for i, (k, v) in enumerate(self.rings):
            feeds[f"ring_k_{i}"], feeds[f"ring_v_{i}"] = k, v
            rings[f"ring_k_{i}_out"], rings[f"ring_v_{i}_out"] = k, v  # aliased: the plugin updates them in place
        out = self.engine.run(feeds, rings)
        self.lengths += counts
        return out

    def reset(self, slots: list[int]) -> None:
        for s in slots:
            self.pending[s] = []
            self.lengths[s] = 0


def context_chunks(pending: list[list[torch.Tensor]], window: int, chunk: int
                   ) -> tuple[torch.Tensor, list[tuple[list, torch.Tensor]]]:
    """Split each slot's pending context rows (a list of [n, F] tensors) into engine calls.

    Only a slot's last `window` rows can matter (the ring keeps W positions), so earlier ones are skipped:
    returns (skipped rows per slot [slots], calls), each call = (rows per slot: [count, F] or None, counts [slots])
    with at most `chunk` rows per slot; there is always at least one call (the one that drafts)."""
    rows = [torch.cat(p)[-window:] if p else None for p in pending]
    skipped = torch.tensor([sum(len(t) for t in p) - (len(r) if r is not None else 0) for p, r in zip(pending, rows)])
    calls = []
    while True:
        part = [None if r is None or not len(r) else r[:chunk] for r in rows]
        calls.append((part, torch.tensor([0 if r is None else len(r) for r in part])))
        rows = [None if r is None or len(r) <= chunk else r[chunk:] for r in rows]
        if all(r is None for r in rows):
            return skipped, calls


def load_engines(root: Path, manifest: dict, dist, spec: bool = True):
    """(TrtTarget, TrtDrafter or None) for this rank; needs one rank per engine (mpirun -n tp)."""
    tp = manifest["mapping"]["tp_size"]
    if dist.size != tp:
        raise EngineError(f"the engines were built for tp {tp}: run with mpirun -n {tp} (one rank per engine)")
    torch.cuda.set_device(dist.rank % torch.cuda.device_count())
    from beamtrt.build import plugins

    plugins.load_library(root / manifest["engines"]["plugin_library"])
    target = TrtTarget(root, manifest, dist.rank)
    return target, TrtDrafter(root, manifest, dist.rank) if spec else None
