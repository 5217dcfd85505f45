"""Micro-benchmark of the plugins' CUDA kernels: attention bytes/s vs a copy, selector µs per step (JSON; needs a GPU).

    python scripts/bench_kernels.py --json bench/kernels.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.bench.kernels"))
