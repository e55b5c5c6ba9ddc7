"""Every message that crosses a process boundary, owned by no side: one module per boundary.

    codec.py     the one checked msgpack codec (typed dataclasses, validated on decode)
    sampling.py  SamplingParams: the one sampling type (router -> worker -> engine)
    worker.py    router <-> worker: generate, abort, status, set_role, output, hand-off
    store/       worker/router <-> KV store: the store's verbs and its replies (base, data
                 server, master)
    tp.py        engine (TP rank 0) -> the other TP ranks: steps and KV commands

Nothing here imports torch, model code, the router or the engine.
"""
