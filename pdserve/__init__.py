"""pdserve: disaggregated prefill/decode LLM serving.

The code lives in the top-level folders serve/, kernels/, kvstore/, router/ and benchmarks/,
installed as pdserve.serve, pdserve.kernels, ... (see pyproject.toml).
"""

__version__ = "0.1.0"
