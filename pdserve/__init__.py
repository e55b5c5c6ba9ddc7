"""pdserve: disaggregated prefill/decode LLM serving.

This package holds what every part shares: the protocol package (pdserve.protocol: every
message that crosses a process, on one codec), the product CLI (pdserve.app.cli) and the
`pdserve up` launcher (pdserve.app.launcher), and the environment settings (pdserve.envs). The
parts live in the top-level folders pdserve/serve/, pdserve/kernels/, pdserve/kvstore/,
pdserve/router/ and benchmarks/, installed as pdserve.serve, pdserve.kernels, ... (see
pyproject.toml).
"""

__version__ = "0.1.0"
