"""Decode tokens/s of the reference target beside its weight-streaming bound (JSON).   python scripts/bench_decode.py"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.bench.decode"))
