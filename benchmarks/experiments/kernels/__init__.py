"""pdserve.benchmarks.experiments.kernels"""
