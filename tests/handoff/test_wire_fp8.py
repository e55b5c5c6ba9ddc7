"""The FP8 hand-off wire (pdserve/handoff/wire_fp8.py, `--handoff-wire fp8`): exactly the bytes
its format says, a decoded error within its stated bound of the fp32 original, raw blocks
untouched, a corrupt header a miss; and through the transports: the node offers encoded
blocks, the fleet store keeps raw ones, and a decode worker's read decodes them."""

from __future__ import annotations

import pytest
import torch

from pdserve.handoff.registry import HandoffChoice, make_transport
from pdserve.handoff.wire_fp8 import (
    FP8_MAX,
    HEADER_BYTES,
    Fp8Wire,
    WireFormatError,
    decode_block,
    decode_blocks,
)
from pdserve.kvstore.tiered_store import TieredStore

SHAPE = [4, 2, 16, 4, 64]  # [num_layers, K|V, block_size, KV heads, head_dim]
NUM_VALUES = 4 * 2 * 16 * 4 * 64
NUM_GROUPS = 4 * 2  # one scale per layer's K and V of the block


def _block(seed: int = 0) -> torch.Tensor:
    """A KV block with an outlier per group and one all-zero group, fp32."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(SHAPE, generator=generator)
    values[:, :, 0, 0, 0] = 40.0  # an outlier sets each group's scale
    values[1, 0] = 0.0
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_encoded_block_is_one_byte_a_value_plus_the_scales(dtype) -> None:
    wire = Fp8Wire.for_block_shape(SHAPE, dtype)
    encoded = wire.encode(_block().to(dtype).view(-1).view(torch.uint8))
    assert encoded.dtype == torch.uint8
    assert encoded.numel() == HEADER_BYTES + 4 * NUM_GROUPS + NUM_VALUES == wire.nbytes
    assert HEADER_BYTES == 16
    assert wire.raw_nbytes == NUM_VALUES * dtype.itemsize
    assert bytes(encoded[:4].numpy()) == b"PDF8"


def test_the_decoded_error_is_within_the_format_s_bound_of_the_fp32_original() -> None:
    original = _block()
    wire = Fp8Wire.for_block_shape(SHAPE, torch.float32)
    decoded = decode_block(wire.encode(original), wire.raw_nbytes)
    assert decoded is not None and decoded.numel() == wire.raw_nbytes
    decoded = decoded.view(torch.float32).view(SHAPE)
    groups = original.view(NUM_GROUPS, -1)
    scales = groups.abs().amax(dim=1, keepdim=True) / FP8_MAX
    error = (decoded.view(NUM_GROUPS, -1) - groups).abs()
    # e4m3: half an ulp is 1/16 of a normal value; subnormal steps are 2^-9 of the scale
    bound = groups.abs() / 16 + scales / 1024
    assert bool((error <= bound).all()), float((error - bound).max())
    assert float(error.max()) > 0  # (it is lossy: the bound is what is promised)
    assert bool((decoded[1, 0] == 0).all())  # an all-zero group stays zero
    largest = original == 40.0
    assert int(largest.sum()) == NUM_GROUPS - 1
    assert bool((decoded[largest] == 40.0).all())  # a group's largest value is exact


def test_a_raw_block_passes_and_a_corrupt_one_is_a_miss() -> None:
    wire = Fp8Wire.for_block_shape(SHAPE, torch.float32)
    raw = _block().view(-1).view(torch.uint8)
    assert decode_block(raw, wire.raw_nbytes) is None  # its length says raw
    encoded = wire.encode(raw)
    bad_count = encoded.clone()
    bad_count[8] += 1  # one group more than the bytes hold
    with pytest.raises(WireFormatError):
        decode_block(bad_count, wire.raw_nbytes)
    bad_dtype = encoded.clone()
    bad_dtype[4] = 9
    with pytest.raises(WireFormatError):
        decode_block(bad_dtype, wire.raw_nbytes)
    # a read keeps the leading good blocks: raw ones as they are, encoded ones decoded
    kept = decode_blocks([raw, encoded, bad_count, encoded], wire.raw_nbytes)
    assert len(kept) == 2 and kept[0] is raw and kept[1].numel() == wire.raw_nbytes


def test_an_fp8_cache_has_nothing_to_encode_and_the_wire_is_not_followed() -> None:
    with pytest.raises(ValueError, match="1 byte a value already"):
        Fp8Wire.for_block_shape(SHAPE, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not followed"):
        HandoffChoice("node", wire="fp8")
    assert HandoffChoice("node", follow=False, wire="fp8").wire == "fp8"


class _Node:
    """A prefill worker's hand-off node, in process: its blocks and leases."""

    address = "tcp://10.213.0.2:7000"
    shm_segment = None

    def __init__(self) -> None:
        self.store = TieredStore.build(16)
        self.leases: dict[int, list[bytes]] = {}

    def put_many(self, keys, blocks):
        return self.store.put_many(keys, blocks)

    def get_many(self, keys):
        return self.store.get_many(keys)

    def pin(self, keys, ttl_s):
        self.leases[len(self.leases) + 1] = list(keys)
        return len(self.leases), [True] * len(keys)

    def release(self, lease_id):
        return self.leases.pop(lease_id, None) is not None

    def locate(self, blocks):
        return None


def test_the_node_offers_encoded_blocks_the_store_raw_ones_and_decode_reads_them() -> None:
    node, fleet = _Node(), TieredStore.build(16)
    wire = Fp8Wire.for_block_shape(SHAPE, torch.float32)
    prefill = make_transport("node", fleet, None, node)  # type: ignore[arg-type]
    prefill.wire = wire
    originals = [_block(seed) for seed in range(4)]
    keys = [bytes([i]) * 16 for i in range(4)]
    offer = prefill.finish(keys, [b.view(-1).view(torch.uint8) for b in originals], 30.0)
    assert offer.error is None and offer.num_stored == 4 and offer.source == node.address
    assert offer.shm_spans is None  # encoded copies are not the staging
    assert [b.nbytes for b in node.get_many(keys)] == [wire.nbytes] * 4
    offer.write_back()
    assert all(torch.equal(torch.as_tensor(stored).view(torch.float32).view(SHAPE), o)
               for stored, o in zip(fleet.get_many(keys), originals, strict=True))

    decode = make_transport("store", fleet, lambda address: node)
    received = decode.receive(keys, node.address, wire.raw_nbytes)
    assert len(received) == 4
    for block, original in zip(received, originals, strict=True):
        values = torch.as_tensor(block).view(torch.float32).view(SHAPE)
        assert float((values - original).abs().max()) <= float(original.abs().max()) / 16
    # the read was measured: 4 blocks' decoded bytes (512 KiB) from the node
    rates = decode.links.as_status()
    assert set(rates) == {f"link_bytes_per_s:{node.address}"}
    assert decode.release(offer.lease_id, node.address) is None and not node.leases


def test_a_store_predicted_faster_is_read_first() -> None:
    node, fleet = _Node(), TieredStore.build(16)
    keys = [bytes([i]) * 16 for i in range(4)]
    blocks = [_block(seed).view(-1).view(torch.uint8) for seed in range(4)]
    node.put_many(keys, blocks)
    fleet.put_many(keys, blocks)
    reads: list[str] = []
    node_get, fleet_get = node.get_many, fleet.get_many
    node.get_many = lambda ks: reads.append("node") or node_get(ks)  # type: ignore[method-assign]
    fleet.get_many = lambda ks: reads.append("store") or fleet_get(ks)  # type: ignore
    block_bytes = blocks[0].numel()
    decode = make_transport("store", fleet, lambda address: node)
    assert len(decode.receive(keys, node.address, block_bytes)) == 4
    assert reads == ["node"]  # nothing measured: the offer's source
    decode = make_transport("store", fleet, lambda address: node)
    decode.links.note(node.address, 8 << 20, 1.0)  # 8 MiB/s
    decode.links.note("", 8 << 20, 0.001)  # 8 GiB/s
    assert len(decode.receive(keys, node.address, block_bytes)) == 4
    assert reads == ["node", "store"]



def test_a_hand_off_over_the_fp8_wire_crosses_encoded_and_lands_within_the_bound(llama_dir):
    """Two workers' gateways (tests/helpers/handoff_util.py), no shared memory, no follow:
    the prefill's node holds the offer encoded, decode loads and decodes it, and what it
    installs is within the format's bound of the prefill's KV (the tokens may differ:
    benchmarks/handoff_wire.py measures by how much)."""
    from helpers.handoff_util import assert_all_free, decode_handoff, handoff_pair, prefill_prompt

    with handoff_pair(llama_dir, 0, shm=False, follow=False) as (prefill, decode, node):
        connector = prefill.kv_transfer.connector
        wire = Fp8Wire.for_block_shape(list(connector.block_shape), connector.dtype)
        sent: list[torch.Tensor] = []
        encode = wire.encode
        wire.encode = lambda block: sent.append(block.clone()) or encode(block)  # type: ignore
        connector.transport.wire = wire
        first = prefill_prompt(prefill)
        keys = list(first.handoff.block_keys)
        assert [b.nbytes for b in node.get_many(keys)] == [wire.nbytes] * len(keys)
        installed: list[list[torch.Tensor]] = []
        install = decode.kv_transfer.install

        def install_and_keep(block_ids, staging):
            installed.append([layer.clone() for layer in staging])
            install(block_ids, staging)

        decode.kv_transfer.install = install_and_keep  # type: ignore[method-assign]
        tokens = decode_handoff(prefill, decode, first)
        assert len(tokens) > 1
        [layers] = installed  # per layer [P, n, block_size, heads, head_dim]
        got = torch.stack(layers).permute(2, 0, 1, 3, 4, 5).float()  # [n, L, P, bs, H, D]
        shape = list(connector.block_shape)
        want = torch.stack([b.view(connector.dtype).view(shape) for b in sent]).float()
        assert got.shape == want.shape and len(sent) == len(keys)
        groups, error = want.flatten(3), (got - want).abs().flatten(3)
        scales = groups.abs().amax(dim=3, keepdim=True) / 448
        assert bool((error <= groups.abs() / 16 + scales / 1024).all())
        totals = decode.kv_transfer.totals()
        assert totals["load_count"] == 1 and totals["in_place_count"] == 0
        assert totals["handoff_bytes"] == len(keys) * connector.block_bytes
        assert_all_free(prefill, decode, node)
