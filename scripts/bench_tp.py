"""Decode tokens/s with and without speculation at TP 1/2/4 and concurrency 1/16/32 under mpirun (JSON).

    python scripts/bench_tp.py --json bench/tp.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.bench.tp"))
