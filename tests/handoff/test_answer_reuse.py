"""KV both ways: a decode worker writes a finished answer's full blocks through to the fleet
store (KVTransfer.save_answer, `--save-answers`), so the prefill of the conversation's next
turn, whose prompt is the last prompt + the answer + new tokens, finds them with its store
lookup and computes only the rest. In process, the worker's own parts: a prefill
RequestGateway with its hand-off node (its prompts written back to the store), a decode
RequestGateway, one TieredStore as the fleet store. Turn 2's tokens equal a colocated
engine's (the loaded KV is right), and every block, lease and pin ends free."""

from __future__ import annotations

import contextlib

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
from pdserve.serve.worker.gateway import RequestGateway
from pdserve.serve.worker.kv_transfer import KVTransfer

ANSWER = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = list(range(3, 28))  # 25 tokens: 3 full blocks and a partial one
# 25 + 16 answer tokens: the last one's KV is never computed, so 40 have KV, 5 full blocks
NUM_ANSWER_BLOCKS = 5 - 3


def connect(address: str) -> StoreClient:
    return StoreClient(address, timeout_s=3.0, holder="test", shm=False)


@contextlib.contextmanager
def workers(llama_dir, store: TieredStore):
    """(prefill, decode, the prefill's node): `pdserve up`'s 1P+1D over one fleet store."""
    engines = [make_engine(llama_dir), make_engine(llama_dir)]
    node = HandoffNode("prefill-p", "127.0.0.1", 32, 30.0, 5.0)
    transfers = []
    for engine, name in zip(engines, ("node", "store"), strict=True):
        layout = engine.spec.kv_layout(BLOCK)
        transport = make_transport(name, store, connect, node if name == "node" else None)
        transfers.append(KVTransfer(engine.runner, engine.block_manager, HandoffConnector(
            store, layout, timeout_s=5.0, lease_ttl_s=30.0, transport=transport)))
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
