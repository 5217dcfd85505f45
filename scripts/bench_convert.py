"""Conversion speed and peak memory of build_engines.py per precision on a generated 4.3 GB random checkpoint (JSON).

    python scripts/bench_convert.py --json bench/convert.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.bench.convert"))
