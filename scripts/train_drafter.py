"""Train a DFlash 2 drafter for a Beam target (default: beam-mini).   python scripts/train_drafter.py --help"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.train.cli"))
