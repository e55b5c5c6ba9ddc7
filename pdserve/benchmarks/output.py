"""Where a benchmark writes what it measured: one folder per benchmark, outside the checkout.

Results are data, not source, so no benchmark writes into the repository or the installed
package: each takes `--output-dir`, which defaults to `$PDSERVE_RESULTS_DIR/<benchmark>`, else
`$XDG_CACHE_HOME/pdserve/results/<benchmark>` (`~/.cache/...` without it). A benchmark's own
file flag (`--output` / `--out`), where it has one, still names one file anywhere.
docs/benchmarks.md keeps the numbers that matter.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdserve import envs


def default_dir(benchmark: str) -> Path:
    """The folder `benchmark` writes into when no --output-dir is given."""
    return Path(envs.results_dir()) / benchmark


def add_output_dir(parser: argparse.ArgumentParser, benchmark: str) -> None:
    """The --output-dir flag every benchmark takes, its default resolved when it is read (so an
    environment set after the parser was built still counts)."""
    parser.add_argument(
        "--output-dir", type=Path, default=None,
        help=f"folder for results and plots (default: $PDSERVE_RESULTS_DIR/{benchmark}, "
             f"else ~/.cache/pdserve/results/{benchmark})")


def output_dir(args: argparse.Namespace, benchmark: str) -> Path:
    """The folder this run writes into: --output-dir, else the default for `benchmark`."""
    chosen = getattr(args, "output_dir", None)
    return Path(chosen) if chosen else default_dir(benchmark)


def output_path(args: argparse.Namespace, benchmark: str, filename: str,
                explicit: str | Path | None = None) -> Path:
    """One result file: `explicit` (a benchmark's --output / --out) where given, else
    `filename` in the run's output folder."""
    if explicit:
        return Path(explicit)
    return output_dir(args, benchmark) / filename
