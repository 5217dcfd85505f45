"""The plugins' kernel math (plugins/), compiled for the host by CMake, against the PyTorch reference; and the CUDA
kernels compiled by nvcc for sm_90, sm_100a and sm_103a (compile only: no GPU in CI)."""

from __future__ import annotations

import ctypes
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from beamtrt.native.kernels import DTYPES, AttentionArgs, SelectorArgs
from beamtrt.spec.selector import draft_probs, greedy_q, walk_greedy, walk_sampled

ROOT = Path(__file__).resolve().parents[1]


def cmake(out: Path, *configure: str, target: str | None = None) -> list[str]:
    """plugins/ configured into `out` (with `configure` flags) and built (`target`, else everything): the two steps'
    logs; fails the test with the log's end when a step fails."""
    log = []
    build = ["cmake", "--build", str(out), "-j", str(os.cpu_count() or 2)] + (["--target", target] if target else [])
    for cmd in (["cmake", "-S", str(ROOT / "plugins"), "-B", str(out), *configure], build):
        done = subprocess.run(cmd, capture_output=True, text=True)
        log.append(done.stdout + done.stderr)
        assert done.returncode == 0, "\n".join(log)[-4000:]
    return log


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """plugins/ configured and built by CMake as the README says (the CUDA kernels too, where nvcc is found); with
    BEAMTRT_PLUGINS_BUILD, that finished build (scripts/gpu_check.sh's, so that its short GPU time builds once)."""
    if prebuilt := os.environ.get("BEAMTRT_PLUGINS_BUILD"):
        return Path(prebuilt), (Path(prebuilt) / "CMakeCache.txt").read_text()
    if shutil.which("cmake") is None:
        pytest.skip("cmake not found")
    out = tmp_path_factory.mktemp("plugins") / "_build"
    return out, "\n".join(cmake(out))


@pytest.fixture(scope="module")
def host(build):
    lib = ctypes.CDLL(str(build[0] / "libbeamtrt_kernels_host.so"))
    assert lib.beamtrt_host_abi() == 1
    return lib


def ptr(t: torch.Tensor) -> int:
    assert t.is_contiguous()
    return t.data_ptr()


# ---- numeric.cuh: the element conversions ---------------------------------------------------------------------

def convert(host, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    dst = torch.empty(src.shape, dtype=dtype)
    host.beamtrt_convert_host(ctypes.c_void_p(ptr(src)), DTYPES[src.dtype], ctypes.c_void_p(ptr(dst)), DTYPES[dtype],
                              ctypes.c_int64(src.numel()))
    return dst


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_widens_exactly(host, dtype):
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    ours, want = convert(host, bits, torch.float32), bits.float()
    assert torch.equal(ours.isnan(), want.isnan()) and torch.equal(ours[~want.isnan()], want[~want.isnan()])


def test_every_fp8_pattern_widens_exactly(host):
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    ours, want = convert(host, bits, torch.float32), bits.float()
    assert torch.equal(ours.isnan(), want.isnan()) and torch.equal(ours[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_narrowing_rounds_to_nearest_even_like_torch(host, dtype):
    g = torch.Generator().manual_seed(0)
    limit = {torch.float16: 65000.0, torch.bfloat16: 1e30, torch.float8_e4m3fn: 440.0}[dtype]
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-6, 1e-3, 0.02, 1.0, 30.0)])
    x = x.clamp(-limit, limit)
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-4, 1.1875, 2**-10, 0.0, -0.0])
    x = torch.cat([x, ties, -ties])
    assert torch.equal(convert(host, x, dtype).view(torch.uint8), x.to(dtype).view(torch.uint8))


# ---- block selector ----------------------------------------------------------------------------------------------

def selector_case(seed: int, codebook_dtype: torch.dtype, N=4, S=7, V=300, K=8, R=16):
    g = torch.Generator().manual_seed(seed)
    return dict(logits=torch.randn(N, S, V, generator=g) * 3, projected=torch.randn(N, S, R, generator=g),
                anchor=torch.randint(0, V, (N,), generator=g, dtype=torch.int32),
                A=(torch.randn(V, R, generator=g) * 0.5).to(codebook_dtype),
                B=(torch.randn(V, R, generator=g) * 0.5).to(codebook_dtype),
                temperature=torch.tensor([0.0, 0.7, 1.3, 1.0])[:N], top_p=torch.tensor([1.0, 0.9, 0.5, 1.0])[:N],
                uniforms=torch.rand(N, S, generator=g), K=K)


def run_selector(lib, c, entry="beamtrt_block_selector_host"):
    """The selector through `lib`'s C entry point: the host build's (void) or the emulated CUDA source's (a status)."""
    N, S, V = c["logits"].shape
    K, R = c["K"], c["projected"].shape[-1]
    out = dict(draft=torch.empty(N, S, dtype=torch.int32), cand=torch.empty(N, S, K, dtype=torch.int32),
               q=torch.empty(N, S, K))
    args = SelectorArgs(N=N, S=S, V=V, K=K, R=R, codebookType=DTYPES[c["A"].dtype],
                        logitsType=DTYPES[c["logits"].dtype], logits=ptr(c["logits"]),
                        projected=ptr(c["projected"]), anchorIds=ptr(c["anchor"]), predecessor=ptr(c["A"]),
                        successor=ptr(c["B"]), temperature=ptr(c["temperature"]), topP=ptr(c["top_p"]),
                        uniforms=ptr(c["uniforms"]), draftIds=ptr(out["draft"]), candIds=ptr(out["cand"]),
                        q=ptr(out["q"]))
    call = getattr(lib, entry)
    call.restype = ctypes.c_int32 if entry.endswith("_emulated") else None
    assert call(ctypes.byref(args)) in (None, 0)
    return out


def reference_lattice(c):
    """CandidateSelector.edge_scores with g given (the plugin's input is the projected hidden W_h h_t); the top-K
    by a stable sort, as the kernel breaks ties (frequent with bf16 logits) to the lower id, which torch.topk does
    not promise."""
    unary, cand = (t[..., :c["K"]] for t in torch.sort(c["logits"].float(), dim=-1, descending=True, stable=True))
    N = cand.shape[0]
    pred = torch.cat((c["anchor"].long().view(N, 1, 1).expand(N, 1, c["K"]), cand[:, :-1]), dim=1)
    a, b = c["A"][pred].float(), c["B"][cand].float()
    edge = torch.einsum("nsir,nsjr->nsij", a * c["projected"].unsqueeze(2), b)
    return cand, unary.unsqueeze(2) + edge


@pytest.mark.parametrize("codebook_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_selector_equals_the_reference_walks(host, seed, codebook_dtype, logits_dtype):
    c = selector_case(seed, codebook_dtype)
    c["logits"] = c["logits"].to(logits_dtype)
    got = run_selector(host, c)
    cand, scores = reference_lattice(c)
    assert torch.equal(got["cand"].long(), cand)
    for n in range(cand.shape[0]):
        t, p = float(c["temperature"][n]), float(c["top_p"][n])
        if t == 0:
            draft, chosen = walk_greedy(cand[n:n + 1], scores[n:n + 1])
            q = greedy_q(scores[n:n + 1], chosen)  # the rows it read, at temperature 1 (the draft confidence)
        else:
            draft, q = walk_sampled(cand[n:n + 1], scores[n:n + 1], t, p, c["uniforms"][n:n + 1])
        assert torch.equal(got["draft"][n:n + 1].long(), draft)
        torch.testing.assert_close(got["q"][n:n + 1], q, rtol=1e-5, atol=1e-6)


def test_selector_top_p_keeps_the_smallest_prefix(host):
    c = selector_case(3, torch.float32, N=4, S=3, V=50, K=6)
    c["temperature"], c["top_p"] = torch.full((4,), 0.5), torch.tensor([0.2, 0.5, 0.95, 1.0])
    got = run_selector(host, c)
    _, scores = reference_lattice(c)
    for n in range(4):  # slot 0's row is the anchor's: compare its q with draft_probs directly
        want = draft_probs(scores[n, 0, 0], 0.5, float(c["top_p"][n]))
        torch.testing.assert_close(got["q"][n, 0], want, rtol=1e-5, atol=1e-6)
    assert (got["q"][0, 0] > 0).sum() < (got["q"][3, 0] > 0).sum()


def test_selector_draws_inside_its_candidates_from_a_row_without_mass(host):
    """A q row with no positive entry (top_p 0, which the decoder never passes, or NaN logits) draws candidate 0: the
    draw was index -1, and the walk read the candidate before the slot's own."""
    c = selector_case(5, torch.float32, N=2, S=3, V=50, K=6)
    c["temperature"], c["top_p"] = torch.full((2,), 1.0), torch.zeros(2)
    got = run_selector(host, c)
    assert torch.equal(got["draft"], got["cand"][..., 0])


def test_selector_greedy_walk_takes_the_first_of_tied_candidates(build, host):
    """Tied scores (a zero projected hidden, as a DFlash v1 drafter loaded as DFlash2 has, over equal logits): the walk
    takes the first candidate, as walk_greedy's torch.argmax does (taking the last survived the random cases)."""
    c = selector_case(4, torch.bfloat16)
    c["projected"], c["logits"] = torch.zeros_like(c["projected"]), torch.zeros_like(c["logits"])
    c["temperature"] = torch.zeros_like(c["temperature"])
    got = emulated_equals_host(build, host, c)
    cand, scores = reference_lattice(c)
    assert torch.equal(got["cand"].long(), cand) and torch.equal(got["draft"].long(), walk_greedy(cand, scores)[0])
    assert torch.equal(got["draft"], got["cand"][..., 0])


def emulated_equals_host(build, host, c) -> dict:
    """The selector on case `c` through block_selector/kernel.cu run on host threads and through the host build:
    candidates, drafts and q rows equal bit for bit (the same operations in the same order, on the same host). Returns
    the host build's outputs."""
    emulated = ctypes.CDLL(str(build[0] / "libbeamtrt_selector_emulated.so"))
    want, got = run_selector(host, c), run_selector(emulated, c, "beamtrt_block_selector_emulated")
    assert torch.equal(got["cand"], want["cand"]) and torch.equal(got["draft"], want["draft"])
    assert torch.equal(got["q"], want["q"])
    return want


@pytest.mark.parametrize("shape,logits_dtype,codebook_dtype", [
    (dict(V=5000, K=16, R=32, S=2), torch.float32, torch.float32),       # 3 chunks per row, 16-byte loads
    (dict(V=4001, K=64, R=100, S=2, N=2), torch.bfloat16, torch.bfloat16),  # K 64, unaligned rows, 2 rank tiles
    (dict(V=3000, K=8, R=70, S=2, N=3), torch.float16, torch.bfloat16),
    (dict(V=3000, K=16, R=600, S=3, N=2), torch.float32, torch.float32),   # 3 rank tiles of up to 259
], ids=["fp32", "bf16-k64", "fp16-k8", "fp32-r600"])
def test_selector_cuda_source_on_host_threads_equals_the_host_build(build, host, shape, logits_dtype, codebook_dtype):
    """block_selector/kernel.cu itself (chunked top-K, warp merges, the edge lattice, the choices, the walk) run through
    host/emulation/cuda_runtime.h, one host thread per CUDA thread: the GPU tests' comparison, on every machine."""
    c = selector_case(4, codebook_dtype, **{"N": 4, "S": 7, **shape})
    c["logits"] = c["logits"].to(logits_dtype)
    emulated_equals_host(build, host, c)


def test_selector_cuda_source_keeps_a_value_just_above_the_raised_warp_floor(build, host):
    """The top-K kernel raises each warp's floor to its K-th best between load batches; a value arriving later just
    inside the K best must still get in. Vocabulary 144,001 at K 32 is 16 chunks of 9,008 bf16 logits (the last
    8,881: a 1-logit tail after its 16-byte loads), 1,126 vectors of 8, so a full load batch and a partial one: warp 0
    (vectors 0-31 of every 256) sees the chunk's only high values, 64 distinct ones in batch 1, then in batch 2 one
    between its 32nd and 31st best. A floor one rank too high drops it."""
    c = selector_case(5, torch.float32, N=1, S=1, V=144001, K=32, R=8)
    vector = torch.arange(9008) // 8  # chunk 0's logits
    warp0 = vector % 256 < 32
    high = torch.nonzero(warp0 & (vector < 1024)).flatten()
    high = high[torch.randperm(len(high), generator=torch.Generator().manual_seed(5))[:64]]
    row = torch.full((9008,), -10.0)
    row[high] = 10.0 + torch.arange(64.0)  # 10 ... 73, exact in bf16: the 32nd best is 42
    row[torch.nonzero(warp0 & (vector >= 1024))[7]] = 42.5
    c["logits"] = torch.full((1, 1, 144001), -10.0)
    c["logits"][0, 0, :9008] = row
    c["logits"] = c["logits"].bfloat16()
    want = emulated_equals_host(build, host, c)
    assert 42.5 in c["logits"][0, 0, want["cand"][0, 0].long()].float()


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_selector_cuda_source_is_race_free_and_in_bounds(sanitizer, tmp_path):
    """plugins/host/sanitize_selector.cpp: the CUDA source on host threads under ThreadSanitizer (a shared-memory
    access that no barrier orders is a data race: deleting the barrier before the choices is caught) and under
    AddressSanitizer + UBSan (every input, the workspace and the shared arrays exactly sized)."""
    exe = tmp_path / "sanitize_selector"
    built = subprocess.run(["g++", "-std=c++20", "-O1", "-g", f"-fsanitize={sanitizer}", "-fno-sanitize-recover=all",
                            "-pthread", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas",
                            f"-I{ROOT / 'plugins' / 'host' / 'emulation'}",
                            str(ROOT / "plugins" / "host" / "sanitize_selector.cpp"), "-o", str(exe)],
                           capture_output=True, text=True)
    if built.returncode != 0 and re.search(r"cannot find .*(tsan|asan|ubsan)", built.stderr):
        pytest.skip(f"no {sanitizer} sanitizer runtime for g++ here")
    assert built.returncode == 0, built.stderr[-3000:]
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TSAN_OPTIONS": "halt_on_error=1"})
    assert done.returncode == 0 and not done.stderr, done.stderr[-4000:]


# ---- windowed attention -------------------------------------------------------------------------------------------

def attention_case(seed, io=torch.float32, N=3, L=4, C=6, Hq=8, Hkv=2, D=16, W=8,
                   start=(0, 5, 9), count=(6, 2, 6)):
    g = torch.Generator().manual_seed(seed)
    t = lambda *shape: torch.randn(*shape, generator=g).to(io)  # noqa: E731
    return dict(q=t(N, L, Hq, D), k=t(N, L, Hkv, D), v=t(N, L, Hkv, D), ck=t(N, C, Hkv, D), cv=t(N, C, Hkv, D),
                start=torch.tensor(start, dtype=torch.int32), count=torch.tensor(count, dtype=torch.int32),
                ring_k=t(N, Hkv, W, D), ring_v=t(N, Hkv, W, D), W=W)


def run_attention(host, c, cache_dtype=None, scale=1.0):
    N, L, Hq, D = c["q"].shape
    Hkv, C = c["k"].shape[2], c["ck"].shape[1]
    cache_dtype = cache_dtype or c["q"].dtype
    ring_k = (c["ring_k"].float() / scale).to(cache_dtype).contiguous()
    ring_v = (c["ring_v"].float() / scale).to(cache_dtype).contiguous()
    out = torch.empty_like(c["q"])
    args = AttentionArgs(N=N, L=L, C=C, Hq=Hq, Hkv=Hkv, D=D, W=c["W"], ioType=DTYPES[c["q"].dtype],
                         cacheType=DTYPES[cache_dtype], cacheScale=scale, softmaxScale=1 / math.sqrt(D),
                         q=ptr(c["q"]), k=ptr(c["k"]), v=ptr(c["v"]), contextK=ptr(c["ck"]), contextV=ptr(c["cv"]),
                         start=ptr(c["start"]), count=ptr(c["count"]), ringK=ptr(ring_k), ringV=ptr(ring_v),
                         out=ptr(out))
    host.beamtrt_windowed_attention_host(ctypes.byref(args))
    return out, ring_k, ring_v


def reference_attention(c, dequant=lambda ring: ring.float()):
    """DraftCache's ring rule (keep the last W of an append; position p -> slot p mod W) and DraftAttention's
    attention over the visible slots plus the bidirectional block, in fp32."""
    N, L, Hq, D = c["q"].shape
    W = c["W"]
    ring_k, ring_v = c["ring_k"].clone(), c["ring_v"].clone()
    for n in range(N):
        s, m = int(c["start"][n]), int(c["count"][n])
        for i in range(m):
            if s + i >= s + m - W:
                ring_k[n, :, (s + i) % W], ring_v[n, :, (s + i) % W] = c["ck"][n, i], c["cv"][n, i]
    out = torch.empty(N, L, Hq, D)
    for n in range(N):
        used = min(int(c["start"][n] + c["count"][n]), W)
        keys = torch.cat((dequant(ring_k)[n, :, :used], c["k"][n].float().transpose(0, 1)), dim=1)  # [Hkv, S, D]
        values = torch.cat((dequant(ring_v)[n, :, :used], c["v"][n].float().transpose(0, 1)), dim=1)
        out[n] = F.scaled_dot_product_attention(c["q"][n].float().transpose(0, 1)[None], keys[None], values[None],
                                                enable_gqa=True)[0].transpose(0, 1)
    return out, ring_k, ring_v


@pytest.mark.parametrize("shape", [
    dict(),                                                                   # partial ring, a wrap, a long append
    dict(N=2, Hq=4, Hkv=4, start=(3, 0), count=(0, 1)),                       # MHA, no append, a single row
    dict(N=2, Hq=6, Hkv=1, D=10, W=5, C=12, start=(2, 40), count=(12, 7)),   # MQA, odd D, appends beyond W
])
def test_attention_equals_the_reference_fp32(host, shape):
    c = attention_case(0, **shape)
    out, ring_k, ring_v = run_attention(host, c)
    want, want_k, want_v = reference_attention(c)
    assert torch.equal(ring_k, want_k) and torch.equal(ring_v, want_v)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("io", [torch.bfloat16, torch.float16])
def test_attention_half_precision_io(host, io):
    c = attention_case(1, io=io)
    out, ring_k, ring_v = run_attention(host, c)
    want, want_k, want_v = reference_attention(c)
    assert torch.equal(ring_k, want_k) and torch.equal(ring_v, want_v)  # the append copies bits
    torch.testing.assert_close(out, want.to(io), rtol=1e-2, atol=1e-2)  # fp32 math, rounded once to io
    assert (out.float() - want).abs().max() <= want.abs().max() * 2**-7


def test_attention_fp8_ring(host):
    scale = 0.05
    c = attention_case(2, io=torch.bfloat16)
    out, ring_k, ring_v = run_attention(host, c, torch.float8_e4m3fn, scale)
    want, want_k, want_v = reference_attention(c, dequant=lambda r: (r.float() / scale).to(torch.float8_e4m3fn)
                                               .float() * scale)
    assert torch.equal(ring_k.view(torch.uint8), (want_k.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(ring_v.view(torch.uint8), (want_v.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    torch.testing.assert_close(out, want.to(torch.bfloat16), rtol=1e-2, atol=1e-2)


# ---- the CUDA build -----------------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (CI has it)")
def test_cuda_kernels_compile_for_hopper_and_blackwell(build):
    out, log = build
    lib = out / "libbeamtrt_kernels.a"
    assert lib.exists(), log[-2000:]
    archs = set(subprocess.run(["strings", str(lib)], capture_output=True, text=True).stdout.split())
    assert {"sm_90", "sm_100a", "sm_103a"} <= archs
    assert "TensorRT headers not found" in log or "TensorRT headers in" in log  # CMake says what it did


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("cmake") is None, reason="needs nvcc and cmake")
def test_an_architecture_named_as_nvcc_does_is_refused_at_configure(tmp_path):
    """-DBEAMTRT_CUDA_ARCHS=sm_90 configured, then failed in nvcc ('Unsupported gpu architecture compute_sm_90')."""
    done = subprocess.run(["cmake", "-S", str(ROOT / "plugins"), "-B", str(tmp_path), "-DBEAMTRT_CUDA_ARCHS=sm_90"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "BEAMTRT_CUDA_ARCHS takes numbers such as 90;100a, got 'sm_90'" in done.stderr


TENSORRT_ROOTS = [r for r in os.environ.get("BEAMTRT_TENSORRT_ROOTS", "").split(os.pathsep) if r]


@pytest.mark.skipif(shutil.which("nvcc") is None or not TENSORRT_ROOTS,
                    reason="needs nvcc and TensorRT headers: BEAMTRT_TENSORRT_ROOTS=DIR[:DIR...], trees whose include/ "
                           "has NvInfer.h (none in CI)")
@pytest.mark.parametrize("root", TENSORRT_ROOTS or ["-"])
def test_plugin_library_builds_against_tensorrt_headers(root, tmp_path):
    """The TensorRT glue as build_engines.py builds it, warnings as errors, against each header tree given (TensorRT
    10.x for TensorRT-LLM 1.2.x, 11.x), exporting TensorRT's two plugin-library entry points."""
    out = tmp_path / "_build"
    log = cmake(out, f"-DTensorRT_ROOT={root}", "-DBEAMTRT_CUDA_ARCHS=90",  # one arch: the glue has none
                target="beamtrt_plugins")
    assert "TensorRT headers in" in log[0]
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(out / "libbeamtrt_plugins.so")], capture_output=True,
                             text=True, check=True).stdout.split()
    assert {"getCreators", "setLoggerFinder"} <= set(symbols)


@pytest.fixture(scope="module")
def torch_ext(build, tmp_path_factory):
    """plugins/torch_ext built with this host's torch against the CUDA kernels' static library: it links and loads
    without a GPU (the CUDA runtime is linked statically and starts only at a first launch), so the first GPU host
    builds code that has compiled, and the extension's argument checks, which come before the device check, run here."""
    from torch.utils.cpp_extension import load

    from beamtrt.native import cuda

    out, log = build
    lib = out / "libbeamtrt_kernels.a"
    assert lib.exists(), log[-2000:]
    cudart = Path(re.search(r"^CUDA_cudart_static_LIBRARY:FILEPATH=(.+)$", (out / "CMakeCache.txt").read_text(),
                            flags=re.M).group(1))
    include = cudart.parent.parent / "include"  # lib/ or lib64/ beside include/, also under targets/<arch>/
    assert (include / "cuda_runtime.h").is_file(), include
    return load(name="beamtrt_cuda_host_link", sources=[str(ROOT / "plugins" / cuda.SOURCES[0])],
                build_directory=str(tmp_path_factory.mktemp("torch_ext")),
                extra_include_paths=[str(ROOT / "plugins"), str(include)],
                extra_cflags=["-O0", "-std=c++20", "-Wall", "-Wextra", "-Werror"],
                extra_ldflags=[str(lib), str(cudart), "-lrt", "-ldl", "-lpthread"])


def test_the_torch_extension_sources_have_names_of_their_own():
    """torch's load() names each object after its source's file name: two kernel.cu would collide (the first GPU host
    ran into it), hence torch_ext/'s one-line includes."""
    from beamtrt.native import cuda

    names = [Path(s).stem for s in cuda.SOURCES]
    assert len(set(names)) == len(names) and all((ROOT / "plugins" / s).is_file() for s in cuda.SOURCES)


def test_a_failed_extension_build_is_one_line(tmp_path, monkeypatch):
    """torch's load() raises RuntimeError on a compile error (or no ninja): bench_kernels.py passed it on as a
    traceback. Then the line kept was its first, ninja's command line, and the error named a log that nothing wrote:
    now the compiler's first error, and the whole output in build.log (gpu_check.sh prints it)."""
    from torch.utils import cpp_extension

    from beamtrt.errors import DeviceError
    from beamtrt.native import cuda

    output = ("Error building extension 'beamtrt_cuda': [1/3] nvcc -c block_selector.cu\nFAILED: block_selector.o\n"
              'kernel.cu(3): error: identifier "y" is undefined\nninja: build stopped: subcommand failed.')

    def fail(**kwargs):
        raise RuntimeError(output)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host's answers
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(cuda, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", fail)
    cuda.extension.cache_clear()
    try:
        with pytest.raises(DeviceError) as failed:
            cuda.extension()
        log = tmp_path / "cuda" / "sm_90a" / "build.log"
        assert str(failed.value) == ('building the CUDA kernels failed (kernel.cu(3): error: identifier "y" is '
                                     f"undefined); the compiler's output is in {log}")
        assert cuda.build_log() == log and log.read_text() == f"RuntimeError: {output}\n"
        monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: "built")
        cuda.extension.cache_clear()
        assert cuda.extension() == "built" and not log.exists()  # a later build's success leaves no old log
    finally:
        cuda.extension.cache_clear()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found (CI has it)")
def test_the_torch_extension_links_and_checks_its_arguments(torch_ext, monkeypatch):
    """beamtrt.native.cuda's wrappers against the extension's bindings: right arguments reach the device check; a
    wrong shape, dtype or size is refused with one line naming the argument, before anything is launched."""
    from beamtrt.native import cuda

    monkeypatch.setattr(cuda, "extension", lambda: torch_ext)
    names = ("logits", "projected", "anchor", "A", "B", "temperature", "top_p", "uniforms")
    attention_names = ("q", "k", "v", "ck", "cv", "start", "count", "ring_k", "ring_v")

    def selector(**change):
        c = {**selector_case(0, torch.bfloat16), **change}
        return cuda.block_selector(*(c[n] for n in names), c["K"])

    def attention(**change):
        c = {**attention_case(0, io=torch.bfloat16), **change}
        return cuda.windowed_attention(*(c[n] for n in attention_names))

    refused = [
        (selector, {}, "CUDA tensors expected, got one on cpu"),
        (selector, dict(uniforms=torch.rand(4, 6)), r"uniforms: a contiguous tensor of shape \[4, 7\]"),
        (selector, dict(projected=torch.randn(4, 16, 7).transpose(1, 2)), "projected: a contiguous tensor"),
        (selector, dict(B=torch.randn(300, 16)), "successor: BFloat16 expected, got Float"),
        (selector, dict(anchor=torch.zeros(4, dtype=torch.int64)), "anchor_ids: Int expected, got Long"),
        (selector, dict(logits=torch.randn(4, 7, 300).to(torch.float8_e4m3fn)), "logits: Float or Half or BFloat16"),
        (selector, dict(K=65), r"top_k: 1 to min\(V, 64\) expected, got 65"),
        (selector, dict(logits=torch.randn(4, 32, 300), projected=torch.randn(4, 32, 16),
                        uniforms=torch.rand(4, 32)), "1 to 31 draft slots expected, got 32"),
        (attention, {}, "CUDA tensors expected, got one on cpu"),
        (attention, dict(ring_v=torch.randn(3, 2, 9, 16).bfloat16()),
         r"ring_v: a contiguous tensor of shape \[3, 2, 8, 16\]"),
        (attention, dict(ck=torch.randn(3, 6, 2, 16)), "context_k: BFloat16 expected, got Float"),
        (attention, dict(start=torch.zeros(3, dtype=torch.int64)), "start: Int expected, got Long"),
        (attention, dict(q=torch.randn(3, 4, 7, 16).bfloat16()), "q: a multiple of k's 2 heads expected, got 7"),
    ]
    for call, change, message in refused:
        with pytest.raises(RuntimeError, match=message):
            call(**change)
    ok = attention_case(0, io=torch.bfloat16)
    fp8 = {n: ok[n].to(torch.float8_e4m3fn) for n in ("ring_k", "ring_v")}
    with pytest.raises(RuntimeError, match="CUDA tensors expected"):  # an FP8 ring is an accepted cache dtype
        attention(**fp8)


# ---- the Python side: the only place that knows the plugin names and fields -------------------------------------

def test_python_plugin_table_matches_the_cpp_glue_and_readmes():
    from beamtrt.build import plugins

    for spec, folder in ((plugins.BLOCK_SELECTOR, "block_selector"),
                         (plugins.WINDOWED_ATTENTION, "windowed_attention")):
        header, source = (ROOT / "plugins" / folder / "plugin.h").read_text(), ROOT / "plugins" / folder / "plugin.cpp"
        assert f'kName = "{spec.name}"' in header
        assert f"kInputs = {len(spec.inputs)};" in header and f"kOutputs = {len(spec.outputs)};" in header
        fields = re.findall(r'\{"(\w+)", PluginFieldType::k(INT32|FLOAT32)', source.read_text())
        assert fields == [(name, kind.upper()) for name, kind in spec.fields]
        readme = (ROOT / "plugins" / folder / "README.md").read_text()
        rows = re.findall(r"^\| (\d+) `(\w+)` \|", readme, flags=re.M)
        assert rows == [(str(i), n) for i, n in enumerate(spec.inputs)] + [(str(i), n) for i, n in
                                                                             enumerate(spec.outputs)]
        assert f"Plugin `{spec.name}`, version `{plugins.VERSION}`, namespace `{plugins.NAMESPACE}`" in readme


# ---- the CUDA kernels on a GPU (scripts/gpu_check.sh) --------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("codebook_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [
    dict(V=5000, K=16, R=32),            # 3 vocabulary chunks per row, one partial rank tile
    dict(V=40_001, K=64, R=100, S=5),    # K = 64 (8 chunks); rows past the first not 16-byte aligned; 2 rank tiles
    dict(V=151_936, K=16, R=256, N=2),   # Beam's vocabulary, 32 chunks per row
], ids=["small", "k64-unaligned", "beam-vocab"])
def test_cuda_selector_equals_the_host_build(host, codebook_dtype, logits_dtype, shape):
    from beamtrt.native import cuda

    c = selector_case(4, codebook_dtype, **{"N": 4, "S": 7, **shape})
    c["logits"] = c["logits"].to(logits_dtype)  # half-width logits: many ties, broken to the lower id on both sides
    want = run_selector(host, c)
    dev = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    draft, cand, q = cuda.block_selector(dev["logits"], dev["projected"], dev["anchor"], dev["A"], dev["B"],
                                         dev["temperature"], dev["top_p"], dev["uniforms"], c["K"])
    assert torch.equal(cand.cpu(), want["cand"]) and torch.equal(draft.cpu(), want["draft"])
    torch.testing.assert_close(q.cpu(), want["q"], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("io,cache,scale", [(torch.bfloat16, None, 1.0), (torch.float16, None, 1.0),
                                            (torch.bfloat16, torch.float8_e4m3fn, 0.05)])
@pytest.mark.parametrize("shape", [
    dict(L=8, Hq=16, Hkv=4, D=128),   # 32 query rows per KV head: tensor cores (or grouped, 4 dims per lane)
    dict(L=8, Hq=20, Hkv=4, D=64, W=300, start=(0, 250, 1000)),  # Beam's 5 heads per KV head: 40 rows, 5 stages
    dict(L=4, Hq=8, Hkv=8, D=256),    # the grouped kernel, 8 dims per lane
    dict(L=16, Hq=32, Hkv=2, D=64),   # 256 query rows per KV head: the per-row kernel
])
@pytest.mark.parametrize("cuda_cores", [False, True], ids=["auto", "cuda-cores"])
def test_cuda_attention_equals_the_host_build(host, io, cache, scale, shape, cuda_cores):
    from beamtrt.native import cuda

    c = attention_case(5, io=io, N=3, C=16, **{"W": 64, "start": (0, 40, 100), "count": (16, 16, 9), **shape})
    want, want_k, want_v = run_attention(host, c, cache, scale)
    cache = cache or io
    ring_k = (c["ring_k"].float() / scale).to(cache).cuda()
    ring_v = (c["ring_v"].float() / scale).to(cache).cuda()
    out = cuda.windowed_attention(*(c[n].cuda() for n in ("q", "k", "v", "ck", "cv", "start", "count")), ring_k, ring_v,
                                  cache_scale=scale, cuda_cores=cuda_cores)
    assert torch.equal(ring_k.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(ring_v.cpu().view(torch.uint8), want_v.view(torch.uint8))
    torch.testing.assert_close(out.cpu().float(), want.float(), rtol=1e-2, atol=1e-2)
