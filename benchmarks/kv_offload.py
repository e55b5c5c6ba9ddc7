"""`python -m pdserve.benchmarks.kv_offload`: the study lives in benchmarks/experiments/."""
import runpy

if __name__ == "__main__":
    runpy.run_module("pdserve.benchmarks.experiments.kv_offload", run_name="__main__")
