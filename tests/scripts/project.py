"""Where things are, for tests wherever they sit in tests/: the repository root and this folder."""

from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parents[1]
NOTEBOOKS = ROOT / "notebooks"
