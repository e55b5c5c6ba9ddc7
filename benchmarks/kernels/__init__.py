"""benchmarks.kernels"""
