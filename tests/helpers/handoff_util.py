"""Two workers' request gateways on one host, in one process: a prefill RequestGateway whose
KVTransfer has a real HandoffNode with a shared memory segment, a decode RequestGateway, and the
loop that drives them step by step without sockets (tests/handoff/test_handoff_in_place.py,
tests/handoff/test_handoff_follow.py)."""

from __future__ import annotations

import contextlib
import gc
import time

from transformers import AutoTokenizer

from helpers.engine_util import run_to_completion, token_ids
from pdserve import envs
from pdserve.handoff.node_server import HandoffNode
from pdserve.handoff.registry import HandoffChoice
from pdserve.protocol.sampling import SamplingParams
from pdserve.protocol.worker import GenerateRequest, Output
from pdserve.serve.config import CacheConfig, ModelConfig
from pdserve.serve.engine.engine import Engine
from pdserve.serve.worker.follow import StagingAnnouncer
from pdserve.serve.worker.gateway import RequestGateway
from pdserve.serve.worker.kv_transfer import KVTransfer

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(3, 28))  # 25 tokens: three full blocks and a partial one


def make_engine(model_dir) -> Engine:
    return Engine(ModelConfig(str(model_dir)), CacheConfig(block_size=BLOCK, num_blocks=64),
                  tokenizer=AutoTokenizer.from_pretrained(model_dir))


def drive(handoffs: list[RequestGateway], done, timeout_s: float = 60.0) -> list[Output]:
    """The worker loops without sockets: poll transfers, step, collect wire outputs."""
    outputs: list[Output] = []
    deadline = time.monotonic() + timeout_s
    while not done(outputs):
        assert time.monotonic() < deadline, outputs
        for handoff in handoffs:
            outputs += handoff.poll()
            if handoff.engine.has_unfinished_requests():
                outputs += [w for d in handoff.engine.step()
                            if (w := handoff.to_wire(d)) is not None]
        time.sleep(0.002)
    return outputs


def finished(outs: list[Output]) -> bool:
    return any(o.request_id == "r" and o.finish_reason not in (None, "handoff") for o in outs)


def colocated_tokens(llama_dir) -> list[int]:
    """The tokens of PROMPT from one engine, no hand-off."""
    reference = make_engine(llama_dir)
    try:
        reference.add_request(PROMPT, GREEDY, "r")
        return token_ids(run_to_completion(reference)["r"])
    finally:
        reference.shutdown()


@contextlib.contextmanager
def handoff_pair(llama_dir, shm_bytes: int, shm: bool | None = None,
                 follow: bool | None = None):
    """(prefill RequestGateway, decode RequestGateway, the prefill worker's node with a
    segment of `shm_bytes`, 0: none), with the same-host paths `shm` and `follow` (the worker
    flags --handoff-shm / --handoff-follow; None: their defaults). The prefill's stagings are
    announced to its announcer's `send` (a test's; nothing by default)."""
    engines = [make_engine(llama_dir), make_engine(llama_dir)]
    node = HandoffNode("prefill-p", "127.0.0.1", 32, 30.0, 5.0, shm_bytes=shm_bytes)
    choice = HandoffChoice(
        "node", shm=envs.handoff_shm_default() if shm is None else shm,
        follow=envs.handoff_follow_default() if follow is None else follow)
    announcer = StagingAnnouncer(engines[0], send=lambda output: None)
    transfers = [KVTransfer.connect(engines[0].runner, engines[0].block_manager, None,
                                    handoff_node=node, shm=choice.shm,
                                    on_staged=announcer if choice.follow else None),
                 KVTransfer.connect(engines[1].runner, engines[1].block_manager, None,
                                    shm=choice.shm)]
    try:
        yield (RequestGateway(engines[0], "prefill", "p", transfers[0], announcer),
               RequestGateway(engines[1], "decode", "d", transfers[1]), node)
    finally:
        for transfer in transfers:
            transfer.close()
        for engine in engines:
            engine.shutdown()


def prefill_prompt(prefill: RequestGateway) -> Output:
    prefill.add(GenerateRequest("r", PROMPT, GREEDY))
    [first] = [o for o in drive([prefill], lambda outs: any(o.finish_reason == "handoff"
                                                             for o in outs))]
    assert first.handoff is not None and len(first.handoff.block_keys) == 4
    return first


def decode_handoff(prefill: RequestGateway, decode: RequestGateway, first: Output) -> list[int]:
    decode.add(GenerateRequest("r", PROMPT, GREEDY, handoff=first.handoff))
    outputs = drive([prefill, decode], lambda outs: finished(outs) and not decode.is_busy
                     and not prefill.is_busy)
    mine = [o for o in outputs if o.request_id == "r"]
    assert all(o.error is None for o in mine)
    return first.token_ids + [t for o in mine for t in o.token_ids]


def assert_all_free(prefill: RequestGateway, decode: RequestGateway, node: HandoffNode) -> None:
    for handoff in (prefill, decode):  # the releases go out on the connectors' job threads
        assert handoff.kv_transfer.connector.drain(20.0)
    gc.collect()
    assert node.num_leases == 0 and node.num_pinned_blocks == 0
    assert node.num_shm_allocations == 0  # dropped at release: the memory is reused warm
    assert len(node.stagings) == 0  # every save ended or was aborted
    node.check_integrity()
    for handoff in (prefill, decode):
        handoff.engine.block_manager.check_integrity()
        assert handoff.engine.block_manager.num_used_blocks == 0


