"""Where things are: the repository root and the tests' folders, for tests that run scripts or read sources."""
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
ROOT = TESTS.parent
