"""The GPU checks are a user's tool now, scripts/gpu_checks.py (a generated project has it too): this name
stays for the dated benchmark reports that give it. Same arguments, same results."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.argv[0] = str(Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
