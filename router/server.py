"""`pdserve router`: the OpenAI-compatible HTTP server in front of the workers."""

from __future__ import annotations

import argparse
import logging
from dataclasses import fields

from pdserve.router.config import RouterConfig

logger = logging.getLogger(__name__)

_DEFAULTS = {f.name: f.default for f in fields(RouterConfig)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    parser.add_argument("--model", required=True, help="checkpoint directory (tokenizer, "
                        "chat template and context length are read from it)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default=d["host"], help="address to bind")
    parser.add_argument("--port", type=int, default=d["port"])
    parser.add_argument("--prefill", action="append", default=[], metavar="ADDR",
                        help="a prefill worker's ZeroMQ address (repeatable)")
    parser.add_argument("--decode", action="append", default=[], metavar="ADDR",
                        help="a decode worker's ZeroMQ address (repeatable)")
    parser.add_argument("--colocated", action="append", default=[], metavar="ADDR",
                        help="a colocated worker's ZeroMQ address (repeatable)")
    parser.add_argument("--store-master", default=None, metavar="ADDR",
                        help="KV store master control address, for prefix lookups")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-inflight-per-worker", type=int,
                        default=d["max_inflight_per_worker"])
    parser.add_argument("--max-predicted-ttft-s", type=float, default=None)
    parser.add_argument("--first-token-timeout-s", type=float, default=d["first_token_timeout_s"])
    parser.add_argument("--token-timeout-s", type=float, default=d["token_timeout_s"])
    parser.add_argument("--heartbeat-timeout-s", type=float, default=d["heartbeat_timeout_s"])


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        model=args.model, served_model_name=args.served_model_name, host=args.host,
        port=args.port, prefill_addrs=tuple(args.prefill), decode_addrs=tuple(args.decode),
        colocated_addrs=tuple(args.colocated), store_master_addr=args.store_master,
        api_key=args.api_key, max_model_len=args.max_model_len,
        max_inflight_per_worker=args.max_inflight_per_worker,
        max_predicted_ttft_s=args.max_predicted_ttft_s,
        first_token_timeout_s=args.first_token_timeout_s, token_timeout_s=args.token_timeout_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.router.app import build_app

    try:
        config = config_from_args(args)
        app = build_app(config)
    except (ValueError, FileNotFoundError, OSError) as exc:
        logger.error("cannot start the router: %s", exc)
        return 2
    logger.info("router on http://%s:%d/v1", config.host, config.port)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning",
                timeout_graceful_shutdown=5)
    return 0
