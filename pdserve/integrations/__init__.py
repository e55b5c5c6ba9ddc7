"""pdserve.integrations: pdserve's parts used from other serving engines.

    vllm_connector.py   PdserveConnector: vLLM's KV connector (v1 API) over pdserve's store
    vllm_scheduler.py   its scheduler half: key chains, store lookups, load and save plans
    vllm_worker.py      its worker half: vLLM's paged KV as pdserve's pool, loads and saves

An integration imports its engine lazily: pdserve does not depend on the engines it plugs
into, and `import pdserve.integrations.<engine>` works without them installed.
"""
