"""Score a drafter on feature caches' greedy answers, by prompt kind.   python scripts/eval_drafter.py --help"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.train.eval_cli"))
