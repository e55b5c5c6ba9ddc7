"""The router's store lookup (pdserve/router/prefix_index.py StoreLookup): a master that
does not answer costs one timeout, then lookups answer 0 at once for the hold."""

from __future__ import annotations

import asyncio

from helpers.cluster_util import free_port_block

from pdserve.router.prefix_index import StoreLookup


def test_a_silent_master_is_not_asked_again_during_the_hold():
    port = free_port_block(1)  # nothing listens there
    lookup = StoreLookup(f"tcp://127.0.0.1:{port}", timeout_s=0.1, hold_s=3600)
    asked = []
    real = lookup._client.lookup_prefix

    def counting(keys):
        asked.append(len(keys))
        return real(keys)

    lookup._client.lookup_prefix = counting
    try:
        keys = [b"k" * 32, b"l" * 32]
        assert asyncio.run(lookup.num_cached_blocks(keys)) == 0
        assert asyncio.run(lookup.num_cached_blocks(keys)) == 0
        assert asked == [2]  # the second was answered from the hold
        lookup._hold_s = 0.0
        lookup._held_until_s = 0.0  # the hold is over
        assert asyncio.run(lookup.num_cached_blocks(keys)) == 0
        assert asked == [2, 2]
    finally:
        lookup.close()
