"""Benchmarks that emit JSON: the published table (acceptance and side-by-side speedup), decode, speculative step,
conversion, tensor-parallel and kernel micro-benchmarks."""
