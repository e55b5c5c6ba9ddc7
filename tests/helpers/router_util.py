"""The real router app in process, over stand-in workers: for tests of the HTTP surface
(validation, limits, auth) that need no model worker."""

from __future__ import annotations

import time
from pathlib import Path

from pdserve.protocol.worker import (
    WORKER_PROTOCOL,
    GenerateRequest,
    Output,
    TokenLogprob,
    WorkerStatus,
)
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher

WORKER_MAX_MODEL_LEN = 256


class StandInDispatcher(Dispatcher):
    """The real dispatcher and policies; its workers are stand-ins that report a status
    (context WORKER_MAX_MODEL_LEN) and answer every request with one token. Each request is
    encoded as the real dispatcher would send it and answered through the worker protocol's
    codec (a wire error either way fails here too, as it would in a cluster), and its
    sampling params are kept in `sent`."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        for worker in self.workers:
            worker.status = WorkerStatus(
                "w", "colocated", "m", WORKER_MAX_MODEL_LEN, True, 0, 0, 64, 64, 16
            )
            worker.last_seen_s = time.monotonic() + 3600  # alive for the test's length
        self.sent = []

    def start(self) -> None:  # no sockets to poll
        pass

    async def run(self, request_id, prompt_token_ids, sampling, first_worker, phases=None):
        # what the real dispatcher would put on the wire, encoded and checked as a worker would
        request = GenerateRequest(request_id, prompt_token_ids, sampling)
        assert WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(request)) == request
        self.sent.append(sampling)
        first_worker.finish(request_id)
        logprobs = None
        if sampling.logprobs is not None:
            top = {7 + i: -0.5 - i for i in range(max(sampling.logprobs, 1))}
            logprobs = [TokenLogprob(7, -0.5, top)]
        output = Output(
            request_id,
            [7],
            "x",
            "length",
            logprobs=logprobs,
            num_prompt_tokens=len(prompt_token_ids),
        )
        # and the reply as the router would receive it from a worker
        yield WORKER_PROTOCOL.decode(WORKER_PROTOCOL.encode(output))


def router_config(model_dir: Path, **overrides) -> RouterConfig:
    return RouterConfig(model=str(model_dir), colocated_addrs=("tcp://127.0.0.1:1",), **overrides)
