"""pdserve.benchmarks"""
