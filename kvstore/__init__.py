"""pdserve.kvstore: the tiered, fleet-wide KV cache store (Mooncake-style).

    block_key.py       chained block keys (model + KV layout + salt at the root)
    memory_tier.py     device-pool / host-DRAM tier: LRU map of uint8 blocks
    disk_tier.py       disk tier: one checksummed file per block, write-behind, re-indexed
    tiered_store.py    device -> DRAM -> disk: demote on eviction, promote on hit, pins
    lease.py           pins with deadlines (a crashed client never pins forever)
    master.py          metadata: block key -> (node, tier), lookup_prefix, node heartbeats
    messages.py        msgpack control messages, validated against their schema
    channel.py         ZeroMQ request/reply with ids and timeouts
    ucx_transport.py   UCX data plane (ucxx core API, exchanged worker addresses)
    server.py          `pdserve store`: master and/or data server
    master_reporter.py a data-only node's heartbeats and placement reports to its master
    client.py          StoreClient: batch verbs, KV bytes over UCX or ZeroMQ
    connector.py       KVConnector: what a worker calls (lookup, load, save, poll)
    config.py          StoreConfig
"""
