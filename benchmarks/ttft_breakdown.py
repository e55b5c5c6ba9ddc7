"""`python -m pdserve.benchmarks.ttft_breakdown`: the study moved to benchmarks/experiments/."""
import runpy

if __name__ == "__main__":
    runpy.run_module("pdserve.benchmarks.experiments.ttft_breakdown", run_name="__main__")
