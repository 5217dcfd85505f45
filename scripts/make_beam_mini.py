"""Create beam-mini (SmolLM2-135M-Instruct upcycled into Beam's MoE layout).   python scripts/make_beam_mini.py"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.models.beam_mini_cli"))
