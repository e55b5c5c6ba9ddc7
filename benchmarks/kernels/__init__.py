"""pdserve.benchmarks.kernels"""
