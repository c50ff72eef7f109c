"""The scripts of ``benchmarks/`` (outside the package) import here as top-level modules, as
they import each other when run (``python benchmarks/probe_NAME.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
