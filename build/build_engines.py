"""Build TensorRT-LLM checkpoints and engines for Beam + DFlash2.   python build/build_engines.py --precision nvfp4"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without pip install -e

from beamtrt.entry import run  # noqa: E402

if __name__ == "__main__":
    sys.exit(run("beamtrt.build.cli"))
