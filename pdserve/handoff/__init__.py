"""pdserve.handoff: the prefill -> decode KV hand-off, one subsystem.

    base.py          HandoffTransport: the interface a transport implements (prefill side:
                     staging_buffer, begin_save, save_layer, finish, end_save; decode side:
                     reserve, receive, receive_layers, install, release), and its Offer
    registry.py      TRANSPORTS (name -> module:Class, imported when chosen), make_transport,
                     HandoffChoice and choose_handoff: the worker's flags -> its hand-off
    store.py         "store": offers go to the fleet store; decode reads the source a
                     hand-off names, else the store (the reading half every transport shares)
    node.py          "node": offers land in the worker's own data node, in process; same-host
                     shared memory staging; stagings followed layer by layer
    node_server.py   HandoffNode: the worker's own data node (a data-role store server)
    peers.py         PeerNodes: clients of other workers' nodes, failed ones held off
    connector.py     HandoffConnector: the store connector whose saves and loads go through
                     a transport (staging per layer, offers, announcements, pulls)
    staging.py       SegmentMaps: other prefill workers' segments on this host, mapped
    layer_pull.py    LayerPull: a decode worker's pull of a staging on another host
    link_policy.py   LinkMeter (each peer's measured KV bytes per second) and KVSourcePolicy:
                     per request, transfer, store or recompute, by predicted time
    wire_fp8.py      the FP8 wire of an offered block (`--handoff-wire fp8`): encode, decode

The engine-aware half lives with the worker (pdserve/serve/worker/): kv_transfer.py (KVTransfer:
the pool, block keys, the host tier), follow.py (reservations of followed prompts, the
prefill's staging announcer), kv_source.py (the link policy's engine-side inputs and counts)
and admission.py (how a handed-off request joins the batch). This
package imports the shared base and pdserve.kvstore only, never the engine: block ids are ints
and the pool is written through a callable.
"""
