"""Where things are, for tests in any folder: the repository root and the tests' data."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_DATA = REPO_ROOT / "tests" / "data"
SHARED = REPO_ROOT.parent / "shared"
