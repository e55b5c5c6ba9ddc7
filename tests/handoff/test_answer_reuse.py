"""KV both ways: a decode worker writes a finished answer's full blocks through to the fleet
store (KVTransfer.save_answer, `--save-answers`), so the prefill of the conversation's next
turn, whose prompt is the last prompt + the answer + new tokens, finds them with its store
lookup and computes only the rest. In process, the worker's own parts: a prefill
RequestGateway with its hand-off node (its prompts written back to the store), a decode
RequestGateway, one TieredStore as the fleet store. Turn 2's tokens equal a colocated
engine's (the loaded KV is right), and every block, lease and pin ends free."""

from __future__ import annotations

import contextlib
import threading
import time

from helpers.engine_util import run_to_completion, token_ids
from helpers.handoff_util import BLOCK, drive, make_engine

from pdserve.handoff.connector import HandoffConnector
from pdserve.handoff.node_server import HandoffNode
from pdserve.handoff.registry import make_transport
from pdserve.kvstore.block_key import block_keys
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.tiered_store import TieredStore
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import GenerateRequest, Output
from pdserve.serve.worker.gateway import ANSWER_HOLD_S, RequestGateway
from pdserve.serve.worker.kv_transfer import KVTransfer

ANSWER = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = list(range(3, 28))  # 25 tokens: 3 full blocks and a partial one
# 25 + 16 answer tokens: the last one's KV is never computed, so 40 have KV, 5 full blocks
NUM_ANSWER_BLOCKS = 5 - 3


def connect(address: str) -> StoreClient:
    return StoreClient(address, timeout_s=3.0, holder="test", shm=False)


class GatedPuts:
    """The store, whose puts wait until `gate` is set (a store that stopped answering)."""

    def __init__(self, store: TieredStore) -> None:
        self.store, self.gate = store, threading.Event()

    def put_many(self, keys, blocks):
        self.gate.wait(30)
        return self.store.put_many(keys, blocks)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@contextlib.contextmanager
def workers(llama_dir, store: TieredStore, decode_store=None):
    """(prefill, decode, the prefill's node): `pdserve up`'s 1P+1D over one fleet store
    (`decode_store`: decode's client of it, if not the store itself)."""
    engines = [make_engine(llama_dir), make_engine(llama_dir)]
    node = HandoffNode("prefill-p", "127.0.0.1", 32, 30.0, 5.0)
    transfers = []
    for engine, name, backend in zip(engines, ("node", "store"), (store, decode_store or store),
                                     strict=True):
        layout = engine.spec.kv_layout(BLOCK)
        transport = make_transport(name, backend, connect, node if name == "node" else None)
        transfers.append(KVTransfer(engine.runner, engine.block_manager, HandoffConnector(
            backend, layout, timeout_s=5.0, lease_ttl_s=30.0, transport=transport)))
    try:
        yield (RequestGateway(engines[0], "prefill", "p", transfers[0]),
               RequestGateway(engines[1], "decode", "d", transfers[1]), node)
    finally:
        for transfer in transfers:
            transfer.close()
        for engine in engines:
            engine.shutdown()


def chat_turn(prefill: RequestGateway, decode: RequestGateway, request_id: str,
              prompt: list[int]) -> tuple[list[int], int]:
    """(the turn's tokens, the cached prompt tokens its prefill reported)."""
    prefill.add(GenerateRequest(request_id, prompt, ANSWER))
    [first] = [o for o in drive([prefill, decode], lambda outs: any(
        o.finish_reason == "handoff" for o in outs)) if o.finish_reason == "handoff"]
    decode.add(GenerateRequest(request_id, prompt, ANSWER, handoff=first.handoff))
    outputs: list[Output] = drive([prefill, decode], lambda outs: any(
        o.request_id == request_id and o.finish_reason not in (None, "handoff") for o in outs)
        and not decode.is_busy and not prefill.is_busy)
    assert all(o.error is None for o in outputs)
    for gateway in (prefill, decode):  # the write-back, the answer's write-through
        assert gateway.kv_transfer.connector.drain(20.0)
    return first.token_ids + [t for o in outputs if o.request_id == request_id
                              for t in o.token_ids], first.num_cached_tokens


def assert_all_free(store: TieredStore, node: HandoffNode, *gateways: RequestGateway) -> None:
    for gateway in gateways:
        assert gateway.kv_transfer.connector.drain(20.0)
        assert gateway.kv_transfer.num_in_flight == 0 and not gateway.is_busy
        gateway.engine.block_manager.check_integrity()
        assert gateway.engine.block_manager.num_used_blocks == 0
    assert node.num_leases == 0 and node.num_pinned_blocks == 0
    node.check_integrity()
    assert store.num_pinned_blocks == 0
    store.check_integrity()


def test_next_turn_finds_the_answer_in_the_store(llama_dir):
    store = TieredStore.build(dram_capacity_blocks=64)
    with workers(llama_dir, store) as (prefill, decode, node):
        answer, cached = chat_turn(prefill, decode, "t1", PROMPT)
        assert cached == 0 and len(answer) == 16
        totals = decode.kv_transfer.totals()
        assert totals["answer_saved_blocks"] == NUM_ANSWER_BLOCKS
        assert totals["answer_dropped_blocks"] == 0

        turn_2 = PROMPT + answer + list(range(40, 48))  # 49 tokens
        root = prefill.engine.block_manager.root(None)
        keys = block_keys(turn_2, BLOCK, root)
        assert store.lookup_prefix(keys) == 3 + NUM_ANSWER_BLOCKS  # the prompt's, the answer's

        reference = make_engine(llama_dir)  # turn 2 from one engine, nothing reused
        try:
            reference.add_request(turn_2, ANSWER, "t2")
            want = token_ids(run_to_completion(reference)["t2"])
        finally:
            reference.shutdown()
        tokens, cached = chat_turn(prefill, decode, "t2", turn_2)
        assert cached == 40  # the answer's whole blocks, loaded by the prefill worker
        assert tokens == want
        assert_all_free(store, node, prefill, decode)


def test_an_aborted_answer_or_the_flag_off_writes_nothing(llama_dir):
    store = TieredStore.build(dram_capacity_blocks=64)
    with workers(llama_dir, store) as (prefill, decode, node):
        decode.kv_transfer.saves_answers = False  # --no-save-answers
        answer, _ = chat_turn(prefill, decode, "off", PROMPT)
        turn_2 = PROMPT + answer + list(range(40, 48))
        keys = block_keys(turn_2, BLOCK, prefill.engine.block_manager.root(None))
        assert store.lookup_prefix(keys) == 3  # the prompt's blocks only
        decode.kv_transfer.saves_answers = True

        prefill.add(GenerateRequest("gone", PROMPT, ANSWER))
        [first] = [o for o in drive([prefill, decode], lambda outs: any(
            o.finish_reason == "handoff" for o in outs)) if o.finish_reason == "handoff"]
        decode.add(GenerateRequest("gone", PROMPT, ANSWER, handoff=first.handoff))
        drive([prefill, decode], lambda outs: any(o.request_id == "gone" and o.token_ids
                                                  for o in outs))
        decode.abort("gone")  # the client went away mid-answer
        drive([prefill, decode], lambda outs: not decode.is_busy and not prefill.is_busy)
        assert decode.kv_transfer.totals()["answer_saved_blocks"] == 0
        assert_all_free(store, node, prefill, decode)


def test_a_stuck_store_delays_the_last_token_by_the_hold_at_most(llama_dir):
    store = TieredStore.build(dram_capacity_blocks=64)
    stuck = GatedPuts(store)
    with workers(llama_dir, store, stuck) as (prefill, decode, node):
        prefill.add(GenerateRequest("r", PROMPT, ANSWER))
        [first] = [o for o in drive([prefill, decode], lambda outs: any(
            o.finish_reason == "handoff" for o in outs)) if o.finish_reason == "handoff"]
        decode.add(GenerateRequest("r", PROMPT, ANSWER, handoff=first.handoff))
        drive([prefill, decode], lambda outs: decode.engine.has_unfinished_requests())
        outputs = []
        while decode.engine.has_unfinished_requests():
            outputs += [w for d in decode.engine.step() if (w := decode.to_wire(d)) is not None]
        assert not any(o.finish_reason for o in outputs)  # the last one is held: the put
        assert decode.kv_transfer.is_saving_answer("r")
        held_s = time.monotonic()
        [last] = drive([decode], lambda outs: bool(outs))
        assert last.finish_reason == "length" and time.monotonic() - held_s >= ANSWER_HOLD_S
        assert decode.kv_transfer.is_saving_answer("r")  # still stuck, and counted later
        stuck.gate.set()
        drive([prefill, decode], lambda outs: not decode.kv_transfer.num_in_flight)
        assert decode.kv_transfer.totals()["answer_saved_blocks"] == NUM_ANSWER_BLOCKS
        assert_all_free(store, node, prefill, decode)
