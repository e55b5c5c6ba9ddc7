"""`python -m pdserve.benchmarks.step_roofline`: the study moved to benchmarks/experiments/."""
import runpy

if __name__ == "__main__":
    runpy.run_module("pdserve.benchmarks.experiments.step_roofline", run_name="__main__")
