"""Speculative step time split into target / drafter / everything else, beside plain decoding (JSON).

    python scripts/bench_spec.py --batches 1 16 --json bench/spec.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.bench.spec"))
