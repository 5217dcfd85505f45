"""Host kernels: the fused Beam forward for decode and verify steps (beam_step.cpp) and the fused DFlash2 drafter block
and context append (draft_step.cpp) on CPU, built on first use with g++ (shared math in host_math.h).

The torch backend's CPU decode and verify steps (at most `MAX_ROWS` tokens per sequence, any number of sequences)
run here instead of in eager PyTorch: one call per step instead of ~45 small ops per layer, and a weight-streaming
GEMM whose per-row result does not depend on the number of rows, so that a verified row gets the bits of a
single-token step. It covers the reference model without tensor parallelism, quantization hooks or a shared expert;
everything else, and any machine without a C++ compiler, takes the PyTorch path (row-invariant there too, see
models/beam.py StepLayout). The drafter's block and append take the same route under the same conditions (one call
each instead of ~300 ops a step). `BEAMTRT_NATIVE=0` turns both off (A/B measurements, tests of the PyTorch path).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import torch

from beamtrt.cli_util import switch
from beamtrt.config import MAX_BLOCK_SIZE

SOURCES = tuple(Path(__file__).with_name(name) for name in ("beam_step.cpp", "draft_step.cpp"))
MAX_ROWS = MAX_BLOCK_SIZE  # tokens per sequence in a decode or verify step (every block a drafter may be trained
#                        at); longer inputs (prefill) use PyTorch's GEMMs, faster for many rows. Decode and verify take
#                        this path at any batch size, so that a row's bits never depend on the batch (beam-mini fp32,
#                        2-core dev machine: 16 rows x 1 token 0.22 s here against 0.52 s in plain PyTorch; 16 x 9
#                        1.43 s against 1.14 s)
GEMM_ROWS = 16         # a product that asks no row invariance (the drafter's, a prefill's) takes the host GEMM up to
#                        this many rows; PyTorch's GEMMs are faster for more
MAX_HEAD_DIM = 1024    # the RoPE scratch in host_math.h
ABI = 2                # beam_step_abi() of a library this module can drive
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")

_p = ctypes.c_void_p
_i32, _i64 = ctypes.c_int32, ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "q_norm", "k_norm",
                                        "router", "gate_up", "down")] + [("inter", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, _i32) for name in ("dtype", "layers", "hidden", "heads", "kv_heads", "head_dim", "experts",
                                          "top_k", "norm_topk", "tied")] + [
        ("vocab", _i64), ("eps", ctypes.c_float), ("embed", _p), ("final_norm", _p), ("lm_head", _p),
        ("layer", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [(name, _i32) for name in ("rows", "out_rows", "taps", "threads")] + [
        ("k_cache", _p), ("v_cache", _p), ("slots", _i64), ("max_len", _i64)] + [
        (name, _p) for name in ("ids", "slot", "pos", "cos", "sin", "out_index", "logits", "tap_layer", "tap_out")]


class _DraftLayer(ctypes.Structure):  # draft_step.cpp
    _fields_ = [(name, _p) for name in ("input_norm", "post_norm", "qkv_w", "o_w", "q_norm", "k_norm", "gate_up",
                                        "down")] + [("conv_base", _p * 2), ("conv_proj", _p * 2)]


class _Drafter(ctypes.Structure):
    _fields_ = [(name, _i32) for name in ("dtype", "layers", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                          "conv_taps", "conv_group", "features")] + [
        ("eps", ctypes.c_float)] + [(name, _p) for name in ("embed", "fc", "hidden_norm", "final_norm")] + [
        ("layer", ctypes.POINTER(_DraftLayer))]


class _Ring(ctypes.Structure):
    _fields_ = [("k", _p), ("v", _p), ("slots", _i64), ("window", _i64)]


class _Block(ctypes.Structure):
    _fields_ = [(name, _i32) for name in ("n", "block", "threads", "use_conv")] + [
        (name, _p) for name in ("ids", "slot", "start", "cos", "sin", "hidden")]


class _Append(ctypes.Structure):
    _fields_ = [("rows", _i32), ("threads", _i32)] + [
        (name, _p) for name in ("taps", "slot", "ring_slot", "cos", "sin")]


def cache_dir() -> Path:
    """Where built libraries live: $BEAMTRT_CACHE/native, else ~/.cache/beamtrt/native (or under $XDG_CACHE_HOME)."""
    if os.environ.get("BEAMTRT_CACHE"):
        return Path(os.environ["BEAMTRT_CACHE"]) / "native"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "beamtrt" / "native"


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def local_sources(source: Path) -> list[Path]:
    """`source` and every file it includes with #include "...", transitively (paths relative to the includer)."""
    seen, todo = [], [source.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.append(path)
        todo += [(path.parent / name).resolve() for name in _INCLUDE.findall(path.read_text())]
    return seen


def enabled() -> bool:
    """BEAMTRT_NATIVE: 1 (the default) runs the CPU steps on the host kernels where they apply, 0 in PyTorch."""
    return switch("BEAMTRT_NATIVE") == "1"


@lru_cache(maxsize=None)
def host_cpu() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared between hosts, such as a
    network home, must not hand one CPU's library to another)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.machine() + " " + platform.processor()
    return "\n".join(next((line for line in info if line.startswith(key)), "")  # x86's, then Arm's
                     for key in ("model name", "flags", "CPU implementer", "CPU part", "Features"))


def _intact(library: Path) -> bool:
    """Whether a cached library is the file its build wrote (the sha256 beside it): a damaged one would crash the
    process that loads it (a truncated ELF is a bus error, not an exception)."""
    try:
        return (library.with_name(library.name + ".sha256").read_text().strip()
                == hashlib.sha256(library.read_bytes()).hexdigest())
    except OSError:
        return False


def compile_library(sources: Path | Sequence[Path], flags: tuple[str, ...], what: str) -> ctypes.CDLL | None:
    """Build `sources` (one file or several) into a shared library in cache_dir() once per content (the sources and
    their local includes), flags and host CPU (compiled aside, then renamed: never half a file; a cached one that no
    longer matches the hash written beside it is built again); None, after one line on stderr, where it cannot be
    built or loaded."""
    sources = (sources,) if isinstance(sources, Path) else tuple(sources)
    try:
        compiler = shlex.split(os.environ.get("CXX", ""))  # a command line: "ccache g++", "g++ -m64"
    except ValueError as e:
        print(f"beamtrt: CXX={os.environ['CXX']!r} is no command line ({e}), so {what} cannot be built here",
              file=sys.stderr)
        return None
    compiler = compiler or [shutil.which("g++") or shutil.which("c++")]
    if compiler[0] is None:
        print(f"beamtrt: no C++ compiler found, so {what} cannot be built here", file=sys.stderr)
        return None
    files = dict.fromkeys(path for source in sources for path in local_sources(source))  # each once, in order
    content = b"".join(path.read_bytes() for path in files)
    digest = hashlib.sha256(content + " ".join([*compiler, *flags]).encode() + host_cpu().encode()).hexdigest()[:16]
    target = cache_dir() / f"{sources[0].stem}-{digest}.so"
    try:
        if not _intact(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                done = subprocess.run([*compiler, *flags, *map(str, sources), "-o", str(out)], capture_output=True,
                                      text=True)
                if done.returncode != 0:  # the compiler's first error (its first line may be "In file included ...")
                    lines = done.stderr.strip().splitlines() or [f"{compiler[0]} exited {done.returncode}"]
                    raise RuntimeError(next((line for line in lines if "error" in line.lower()), lines[0]))
                check = Path(tmp) / (target.name + ".sha256")
                check.write_text(hashlib.sha256(out.read_bytes()).hexdigest() + "\n")
                os.replace(out, target)  # the library first: a hash beside a stale library fails _intact
                os.replace(check, target.with_name(check.name))
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as e:
        print(f"beamtrt: building {what} failed ({e}); not used", file=sys.stderr)
        return None


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The fused-step library, or None where it cannot be built (the CPU steps then run in PyTorch)."""
    lib = compile_library(SOURCES, FLAGS, "the host kernels")  # its libgomp is the one torch already loaded (same
    if lib is None or lib.beam_step_abi() != ABI:              # soname): one OpenMP thread pool
        return None
    lib.beam_step.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    lib.beam_gemm.argtypes = [_p, _p, _p, _i64, _i64, _i64, _i32, _i32]
    lib.draft_block.argtypes = [ctypes.POINTER(_Drafter), ctypes.POINTER(_Ring), ctypes.POINTER(_Block)]
    lib.draft_append.argtypes = [ctypes.POINTER(_Drafter), ctypes.POINTER(_Ring), ctypes.POINTER(_Append)]
    return lib


def available() -> bool:
    return library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is not None and t.device.type != "cpu":  # the host library would read a device (or meta) address
        raise ValueError(f"the host kernels take CPU tensors, got one on {t.device}")
    return None if t is None else t.data_ptr()


def _hooked(module) -> bool:
    """Whether an activation hook is set on this module: hooks are instance attributes over class defaults of None
    (read from the instance's __dict__: a missing name through nn.Module.__getattr__ costs an exception, and this
    check runs every step)."""
    return any(vars(module).get(h) is not None for h in ("qkv_in", "o_in", "k_out", "v_out", "fc_in", "proj_in",
                                                           "reduce"))


class _Descriptor:
    """The model's weight pointers for beam_step, holding the tensors they point into."""

    def __init__(self, model):
        cfg = model.cfg
        layers = (_Layer * cfg.num_hidden_layers)()
        self.tensors = [p for p in model.parameters()]
        for layer, d in zip(model.layers, layers):
            attn, mlp = layer.attn, layer.mlp
            moe = hasattr(mlp, "router")
            d.input_norm, d.post_norm = _ptr(layer.input_norm.weight), _ptr(layer.post_attn_norm.weight)
            d.qkv_w, d.qkv_b, d.o_w, d.o_b = (_ptr(attn.qkv.weight), _ptr(attn.qkv.bias), _ptr(attn.o_proj.weight),
                                              _ptr(attn.o_proj.bias))
            d.q_norm = _ptr(attn.q_norm.weight) if attn.q_norm is not None else None
            d.k_norm = _ptr(attn.k_norm.weight) if attn.k_norm is not None else None
            if moe:
                d.router, d.gate_up, d.down = _ptr(mlp.router.weight), _ptr(mlp.w_gate_up), _ptr(mlp.w_down)
                d.inter = cfg.moe_intermediate_size
            else:
                d.router, d.gate_up, d.down, d.inter = None, _ptr(mlp.gate_up.weight), _ptr(mlp.down.weight), \
                    cfg.intermediate_size
        head = model.head_weight
        self.layers = layers
        self.model = _Model(dtype=DTYPES[model.dtype], layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                            experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, norm_topk=int(cfg.norm_topk_prob),
                            tied=int(model.lm_head is None), vocab=head.shape[0], eps=cfg.rms_norm_eps,
                            embed=_ptr(model.embed.weight), final_norm=_ptr(model.norm.weight), lm_head=_ptr(head),
                            layer=layers)
        self.key = tuple(map(_ptr, self.tensors))
        self.contiguous = all(p.is_contiguous() for p in self.tensors)


def usable(model, cache, tokens_per_row: int) -> bool:
    """Whether beam_step can run this forward (`tokens_per_row` tokens for each sequence) exactly as the PyTorch path
    would (up to fp32 rounding)."""
    if tokens_per_row > MAX_ROWS:
        return False
    if not enabled() or model.shard is not None:
        return False
    if model.dtype not in DTYPES or model.device.type != "cpu" or cache.k.dtype != model.dtype:
        return False
    cfg = model.cfg
    if cfg.shared_expert_intermediate_size or cfg.head_dim > MAX_HEAD_DIM or not available():
        return False
    if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        return False
    if any(_hooked(layer.attn) or _hooked(layer.mlp) for layer in model.layers):
        return False
    return descriptor(model).contiguous


_descriptors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Descriptor, kept off the module
# (ctypes pointers cannot be deep-copied)


def gemm_usable(weight: torch.Tensor, rows: int, any_rows: bool = False) -> bool:
    """Whether `gemm` can take a [rows, K] x weightᵀ product: at most GEMM_ROWS rows (the drafter's LM head on its
    block rows), or any number with `any_rows` (row-invariant products)."""
    return ((any_rows or rows <= GEMM_ROWS) and weight.device.type == "cpu" and weight.dtype in DTYPES
            and weight.is_contiguous() and enabled() and available())


def descriptor(model) -> _Descriptor:
    """Cached per model; rebuilt when a parameter was replaced (load_state copies in place: the pointers hold)."""
    d = _descriptors.get(model)
    if d is None or d.key != tuple(p.data_ptr() for p in model.parameters()):
        d = _descriptors[model] = _Descriptor(model)
    return d


def _check_slots(slots: torch.Tensor, cache) -> None:
    """Cache slots index raw memory here: one outside [0, batch) is refused (-1, the last slot to torch's indexing,
    wrote before the buffer)."""
    if bool((slots < 0).any() | (slots >= cache.batch).any()):
        raise IndexError(f"cache slots must be in [0, {cache.batch}), got {slots.flatten()[:8].tolist()}")


def beam_step(model, cache, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
              out_index: torch.Tensor, taps: list[int], live: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward of B x T token rows through beam_step.cpp; K/V are written into `cache` like the PyTorch path.

    input_ids, positions: [B, T]; rows: [B] cache slot of each input row; out_index: [N] flat rows (b * T + t) whose
    logits are wanted; live: [B, T] bool, the rows to compute (default all): a ragged verify's padding is skipped,
    its logits and taps left zero (every row's bits are the same whatever else the call computes). Returns (raw
    LM-head logits [N, V] fp32, taps: per tapped layer [B, T, H] fp32).
    """
    B, T = input_ids.shape
    H, D = model.cfg.hidden_size, model.cfg.head_dim
    ids = input_ids.reshape(-1).contiguous()
    if bool((ids < 0).any() | (ids >= model.cfg.vocab_size).any()):
        raise IndexError(f"token ids must be in [0, {model.cfg.vocab_size})")
    _check_slots(rows, cache)
    slot = rows.repeat_interleave(T)
    pos = positions.reshape(-1)
    cos, sin = (t.reshape(-1, D) for t in model.rotary(positions, torch.float32))
    wanted = out_index
    if live is not None:  # compact the live rows; out_index then counts live rows only
        flat = live.reshape(-1)
        ids, slot, pos, cos, sin = (t[flat] for t in (ids, slot, pos, cos, sin))
        keep = flat[out_index]
        wanted = (torch.cumsum(flat, 0) - 1)[out_index[keep]]
    ids, slot, pos, cos, sin, wanted = (t.contiguous() for t in (ids, slot, pos, cos, sin, wanted))
    d = descriptor(model)
    logits = torch.empty(wanted.shape[0], d.model.vocab, device="cpu")
    tap_layer = torch.tensor(taps, dtype=torch.int32, device="cpu")
    tap_out = torch.empty(len(taps), ids.shape[0], H, device="cpu")
    step = _Step(rows=ids.shape[0], out_rows=wanted.shape[0], taps=len(taps), threads=torch.get_num_threads(),
                 k_cache=_ptr(cache.k), v_cache=_ptr(cache.v), slots=cache.batch, max_len=cache.max_len,
                 ids=_ptr(ids), slot=_ptr(slot), pos=_ptr(pos), cos=_ptr(cos), sin=_ptr(sin),
                 out_index=_ptr(wanted), logits=_ptr(logits), tap_layer=_ptr(tap_layer), tap_out=_ptr(tap_out))
    library().beam_step(ctypes.byref(d.model), ctypes.byref(step))
    if live is None:
        return logits, [t.view(B, T, H) for t in tap_out]
    full = logits.new_zeros(out_index.shape[0], d.model.vocab)
    full[keep] = logits
    taps_full = tap_out.new_zeros(len(taps), B * T, H)
    taps_full[:, flat] = tap_out
    return full, [t.view(B, T, H) for t in taps_full]


def gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 · weight [N, K]ᵀ (fp32 or bf16, contiguous) -> fp32 [M, N], with beam_step's GEMM."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], device="cpu")
    library().beam_gemm(_ptr(x), _ptr(weight), _ptr(y), x.shape[0], weight.shape[0], x.shape[1],
                        DTYPES[weight.dtype], torch.get_num_threads())
    return y


# ---- the DFlash2 drafter (draft_step.cpp) ----------------------------------------------------------------------

class _DraftDescriptor:
    """A drafter's weight pointers for draft_step.cpp, holding the tensors they point into."""

    def __init__(self, drafter):
        cfg = drafter.cfg
        layers = (_DraftLayer * cfg.num_hidden_layers)()
        embed = drafter.target.embed.weight
        self.tensors = [*drafter.parameters(), embed]
        for layer, d in zip(drafter.layers, layers):
            attn = layer.self_attn
            d.input_norm, d.post_norm = _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight)
            d.qkv_w, d.o_w = _ptr(attn.qkv.weight), _ptr(attn.o_proj.weight)
            d.q_norm, d.k_norm = _ptr(attn.q_norm.weight), _ptr(attn.k_norm.weight)
            d.gate_up, d.down = _ptr(layer.mlp.gate_up.weight), _ptr(layer.mlp.down.weight)
            for side, conv in enumerate((layer.attention_conv, layer.mlp_conv)):
                d.conv_base[side], d.conv_proj[side] = _ptr(conv.base_kernel), _ptr(conv.kernel_projection.weight)
        self.layers = layers
        self.model = _Drafter(dtype=DTYPES[drafter.dtype], layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                              heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                              inter=cfg.intermediate_size, conv_taps=cfg.conv_kernel_size,
                              conv_group=cfg.conv_group_size, features=drafter.fc.in_features, eps=cfg.rms_norm_eps,
                              embed=_ptr(embed), fc=_ptr(drafter.fc.weight),
                              hidden_norm=_ptr(drafter.hidden_norm.weight), final_norm=_ptr(drafter.norm.weight),
                              layer=layers)
        self.key = tuple(map(_ptr, self.tensors))
        self.contiguous = all(p.is_contiguous() for p in self.tensors)


_draft_descriptors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def draft_descriptor(drafter) -> _DraftDescriptor:
    """Cached per drafter; rebuilt when a parameter (or the target's embedding) was replaced."""
    d = _draft_descriptors.get(drafter)
    if d is None or d.key != tuple(p.data_ptr() for p in (*drafter.parameters(), drafter.target.embed.weight)):
        d = _draft_descriptors[drafter] = _DraftDescriptor(drafter)
    return d


def draft_usable(drafter, cache) -> bool:
    """Whether draft_step.cpp can run this drafter's block and append as the PyTorch reference does (up to fp32
    rounding): on CPU, fp32 or bf16 throughout (the target's embedding and the ring too), no hooks or shards, the
    windowed-attention plugin kernel not chosen instead (BEAMTRT_KERNELS=host)."""
    if not enabled() or drafter.kernels is not None:
        return False
    embed = drafter.target.embed.weight
    if drafter.dtype not in DTYPES or drafter.device.type != "cpu" or embed.dtype != drafter.dtype:
        return False
    if cache.k.dtype != drafter.dtype or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
        return False
    if drafter.cfg.head_dim > MAX_HEAD_DIM or drafter.target.shard is not None or not available():
        return False
    if any(_hooked(layer.self_attn) or _hooked(layer.mlp) for layer in drafter.layers):
        return False
    return draft_descriptor(drafter).contiguous


def _ring(cache) -> _Ring:
    return _Ring(k=_ptr(cache.k), v=_ptr(cache.v), slots=cache.k.shape[1], window=cache.window)


def draft_block(drafter, cache, ids: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
    """One block per sequence through every draft layer (see DFlash2Drafter.draft). ids: [N, B] anchor + masks;
    slots, start: [N] each sequence's ring and its context length; cos, sin: [N, B, D] fp32 at the block's positions.
    Returns the final-normed hidden of block positions 1..B-1: [N, B - 1, H] fp32."""
    N, B = ids.shape
    ids, slots, start = (t.to(torch.long).contiguous() for t in (ids, slots, start))
    rows = drafter.target.embed.weight.shape[0]
    if bool((ids < 0).any() | (ids >= rows).any()):
        raise IndexError(f"token ids must be in [0, {rows})")
    _check_slots(slots, cache)
    cos, sin = (t.float().reshape(N * B, -1).contiguous() for t in (cos, sin))
    hidden = torch.empty(N, B - 1, drafter.cfg.hidden_size, device="cpu")
    block = _Block(n=N, block=B, threads=torch.get_num_threads(), use_conv=int(drafter.use_conv), ids=_ptr(ids),
                   slot=_ptr(slots), start=_ptr(start), cos=_ptr(cos), sin=_ptr(sin), hidden=_ptr(hidden))
    library().draft_block(ctypes.byref(draft_descriptor(drafter).model), ctypes.byref(_ring(cache)),
                          ctypes.byref(block))
    return hidden


def draft_append(drafter, cache, taps: torch.Tensor, slots: torch.Tensor, ring_slots: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Write M committed tokens' context K/V into every layer's ring (see DFlash2Drafter.append_context). taps:
    [M, F] the target's tapped features; slots, ring_slots: [M] each row's ring and its slot there; cos, sin: [M, D]
    at the rows' positions."""
    taps = taps.float().contiguous()
    slots, ring_slots = slots.to(torch.long).contiguous(), ring_slots.to(torch.long).contiguous()
    _check_slots(slots, cache)
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    rows = _Append(rows=taps.shape[0], threads=torch.get_num_threads(), taps=_ptr(taps), slot=_ptr(slots),
                   ring_slot=_ptr(ring_slots), cos=_ptr(cos), sin=_ptr(sin))
    library().draft_append(ctypes.byref(draft_descriptor(drafter).model), ctypes.byref(_ring(cache)),
                           ctypes.byref(rows))
