"""Write a random Beam-architecture checkpoint of any size.   python scripts/make_random_beam.py --out /tmp/rb"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.models.random_beam_cli"))
