"""Everything GPU-side in one command: benchmarks/gpu/run.sh."""
