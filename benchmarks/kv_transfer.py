"""`python -m pdserve.benchmarks.kv_transfer`: the study moved to benchmarks/experiments/."""
import runpy

if __name__ == "__main__":
    runpy.run_module("pdserve.benchmarks.experiments.kv_transfer", run_name="__main__")
