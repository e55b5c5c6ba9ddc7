"""Every environment variable pdserve reads, in one place (all prefixed PDSERVE_).

Each is read when asked for, never at import, so tests can set them with monkeypatch.
"""

from __future__ import annotations

import os


def attention_backend() -> str | None:
    """PDSERVE_ATTENTION_BACKEND=triton|torch overrides the attention dispatch."""
    value = os.environ.get("PDSERVE_ATTENTION_BACKEND")
    if value is not None and value not in ("triton", "torch"):
        raise ValueError(f"PDSERVE_ATTENTION_BACKEND must be 'triton' or 'torch', got {value!r}")
    return value


def cache_dir() -> str:
    """PDSERVE_CACHE_DIR: where the embedded default model and other built artefacts live."""
    return os.environ.get(
        "PDSERVE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    )


def log_level() -> str:
    """PDSERVE_LOG_LEVEL: the root log level of every pdserve process (default INFO)."""
    return os.environ.get("PDSERVE_LOG_LEVEL", "INFO").upper()
