"""`python -m pdserve.benchmarks.chaos_soak`: the study moved to benchmarks/experiments/."""
import runpy

if __name__ == "__main__":
    runpy.run_module("pdserve.benchmarks.experiments.chaos_soak", run_name="__main__")
