"""pdserve.kvstore: the tiered, fleet-wide KV cache store (Mooncake-style).

    block_key.py       chained block keys (model + KV layout + salt at the root)
    lru_index.py       LRUIndex: the one LRU ordering both tiers keep
    memory_tier.py     device-pool / host-DRAM tier: LRU map of uint8 blocks
    disk_tier.py       disk tier: one checksummed file per block, write-behind, re-indexed
    tiered_store.py    device -> DRAM -> disk: demote on eviction, promote on hit, pins
    lease.py           pins with deadlines (a crashed client never pins forever)
    master.py          metadata: block key -> (node, tier), lookup_prefix, node heartbeats
    channel.py         ZeroMQ request/reply of typed messages, with ids and timeouts
    ucx_transport.py   UCX data plane (ucxx core API, exchanged worker addresses)
    live_staging.py    a data node's saves in progress, served layer by layer (get_layers)
    shm_segment.py     same-host reads: blocks in a memfd segment a client maps and copies,
                       each allocation's header with its serial and a writer's progress
    service.py         what the server's socket loop asks of a service (handlers by type)
    master_service.py  MasterService: the master's verbs (join, update, lookup_prefix, ...)
    data_service.py    DataService: tiered store, leases, UCX clients (put, get, pin, ...)
    server.py          `pdserve store`: one socket loop over the master and/or data service
    master_reporter.py a data-only node's heartbeats and placement reports to its master
    client.py          StoreClient: batch verbs, KV bytes over UCX or ZeroMQ
    connector.py       StoreConnector: what a worker calls (lookup, load, save, poll)
    config.py          StoreConfig

The prefill -> decode hand-off that runs over these parts is pdserve/handoff/.

The messages between a client and the store are typed dataclasses in pdserve/protocol/store/,
on the one checked codec of pdserve/protocol/codec.py.
"""
