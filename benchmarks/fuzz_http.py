"""`python -m pdserve.benchmarks.fuzz_http`: the study moved to benchmarks/experiments/."""
import runpy

if __name__ == "__main__":
    runpy.run_module("pdserve.benchmarks.experiments.fuzz_http", run_name="__main__")
