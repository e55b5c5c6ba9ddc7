"""Helpers the tests share: model factories, clusters, engines, kernels' cases."""
