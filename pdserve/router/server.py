"""`pdserve router`: the OpenAI-compatible HTTP server in front of the workers."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from dataclasses import fields

from pdserve import discovery, envs, lifecycle
from pdserve.router.config import (
    CONTROLLER_MODES,
    ControllerConfig,
    RouterConfig,
    check_otlp_traces_endpoint,
)
from pdserve.router.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)

_DEFAULTS = {f.name: f.default for f in fields(RouterConfig)}
_CONTROLLER = ControllerConfig()


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
    discovery.add_arguments(parser)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    parser.add_argument("--ops-need-api-key", action="store_true",
                        help="/metrics and /status need the API key too (/health stays open)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-request-bytes", type=int, default=d["max_request_bytes"],
                        help="larger request bodies (chunked ones too) get HTTP 413")
    parser.add_argument("--supervisor-state-file", default=None, help=argparse.SUPPRESS)
    add_max_tokens_arguments(parser)
    parser.add_argument("--max-inflight-per-worker", type=int,
                        default=d["max_inflight_per_worker"])
    parser.add_argument("--max-predicted-ttft-s", type=float, default=None)
    parser.add_argument("--first-token-timeout-s", type=float, default=d["first_token_timeout_s"])
    parser.add_argument("--token-timeout-s", type=float, default=d["token_timeout_s"])
    parser.add_argument("--heartbeat-timeout-s", type=float, default=d["heartbeat_timeout_s"])
    parser.add_argument("--max-migrations", type=int, default=d["max_migrations"],
                        help="times one request may move off a worker that died or hung "
                             "(default %(default)s)")
    parser.add_argument("--pool-wait-s", type=float, default=d["pool_wait_s"],
                        help="a request whose pool has no ready worker (a restart) waits this "
                             "long for one before HTTP 503; a migration too (default "
                             "%(default)s; 0: refuse at once)")
    parser.add_argument("--max-pool-waiters", type=int, default=d["max_pool_waiters"],
                        help="requests that may wait so at once; the next gets HTTP 503 at "
                             "once (default %(default)s)")
    add_routing_arguments(parser)
    add_controller_arguments(parser)
    add_tracing_arguments(parser)
    add_tool_arguments(parser)


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    """Tool calling's flags, as vLLM's (`pdserve router` and `pdserve up`;
    pdserve/router/tools.py)."""
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto" (the default when a request has tools) '
                             "by parsing the model's tool calls out of its text")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                        help="the model family's tool-call format: hermes (Qwen2/2.5, "
                             "Hermes), llama3_json (Llama 3.x), mistral, deepseek_v3 "
                             "(DeepSeek-V3/R1/V3.1)")


def tool_argv(args: argparse.Namespace) -> list[str]:
    """The tool-calling flags of `args` as command-line arguments (for `pdserve up`)."""
    argv = ["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []
    if args.tool_call_parser is not None:
        argv += ["--tool-call-parser", args.tool_call_parser]
    return argv


def add_tracing_arguments(parser: argparse.ArgumentParser) -> None:
    """Request tracing (`pdserve router` and `pdserve up`; pdserve/router/tracing.py)."""
    parser.add_argument("--otlp-traces-endpoint", default=envs.otlp_traces_endpoint(),
                        metavar="URL",
                        help="export a trace of every request (OpenTelemetry, OTLP over "
                             "HTTP/protobuf) to URL, e.g. http://localhost:4318/v1/traces "
                             "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: no tracing)")


def tracing_argv(args: argparse.Namespace) -> list[str]:
    """The tracing flag of `args` as command-line arguments (for `pdserve up`, which checks
    it here, before starting anything: ValueError for a bad URL or OTLP protocol)."""
    if args.otlp_traces_endpoint is None:
        return []
    check_otlp_traces_endpoint(args.otlp_traces_endpoint)
    envs.otlp_traces_protocol()
    return ["--otlp-traces-endpoint", args.otlp_traces_endpoint]


def add_max_tokens_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's max_tokens default and ceiling (`pdserve router` and `pdserve up`)."""
    parser.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                        help="max_tokens of a request that sets none, capped to the room left "
                             "in the context (default: 16 for completions, the room left for "
                             "chat, as OpenAI and vLLM do)")
    parser.add_argument("--max-tokens-ceiling", type=int, default=None, metavar="N",
                        help="the most tokens one request may generate: a larger max_tokens "
                             "is a 400 and a request without one gets at most N")


def add_routing_arguments(parser: argparse.ArgumentParser) -> None:
    """How the router picks workers (`pdserve router` and `pdserve up`)."""
    parser.add_argument("--prefill-routing", choices=("cache-aware", "least-load", "round-robin"),
                        default=RouterConfig.prefill_routing,
                        help="how a prefill (or colocated) worker is picked: cache-aware (the "
                             "prompt's prefix it or the store holds, less a penalty per request "
                             "on it), least-load, or round-robin (default %(default)s)")
    parser.add_argument("--local-prefill-max-tokens", type=int,
                        default=RouterConfig.local_prefill_max_tokens,
                        help="disaggregated mode: a prompt with at most this many tokens not "
                             "cached on a decode worker that has headroom is computed on that "
                             "decode worker, not on a prefill worker (conditional "
                             "disaggregation); 0: never (default %(default)s)")


def routing_argv(args: argparse.Namespace) -> list[str]:
    argv = []
    if args.prefill_routing != RouterConfig.prefill_routing:
        argv += ["--prefill-routing", args.prefill_routing]
    if args.local_prefill_max_tokens != RouterConfig.local_prefill_max_tokens:
        argv += ["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    return argv


def max_tokens_argv(args: argparse.Namespace) -> list[str]:
    """The max_tokens flags of `args` as command-line arguments (for `pdserve up`)."""
    argv = []
    if args.default_max_tokens is not None:
        argv += ["--default-max-tokens", str(args.default_max_tokens)]
    if args.max_tokens_ceiling is not None:
        argv += ["--max-tokens-ceiling", str(args.max_tokens_ceiling)]
    return argv


def add_controller_arguments(parser: argparse.ArgumentParser) -> None:
    """The goodput controller's flags (`pdserve router` and `pdserve up` share them)."""
    c = _CONTROLLER
    group = parser.add_argument_group("goodput controller (disaggregated mode)")
    group.add_argument("--controller", choices=CONTROLLER_MODES, default=c.mode,
                       help="recommend: publish the best prefill:decode split in /status and "
                            "/metrics; flip: also move drained workers to it; off: neither")
    group.add_argument("--slo-ttft-ms", type=float, default=c.ttft_slo_s * 1000,
                       help="time-to-first-token SLO the controller plans for")
    group.add_argument("--slo-tpot-ms", type=float, default=c.tpot_slo_s * 1000,
                       help="time-per-output-token SLO the controller plans for")
    group.add_argument("--controller-interval-s", type=float, default=c.interval_s,
                       help="seconds between two estimates")
    group.add_argument("--controller-min-gain", type=float, default=c.min_gain,
                       help="headroom: the current split stays while it meets the SLOs and "
                            "serves this times the arriving rate; a move needs this times the "
                            "current split's capacity, or 5 points more predicted attainment")
    group.add_argument("--controller-window-s", type=float, default=c.window_s,
                       help="the load the controller plans for is what arrived in the last "
                            "this many seconds (its rate, prompt and output lengths)")
    group.add_argument("--controller-cooldown-s", type=float, default=c.cooldown_s,
                       help="no move within this many seconds of the last one (its effect "
                            "shows in the queues first)")
    group.add_argument("--controller-hand-over", action=argparse.BooleanOptionalAction,
                       default=c.hand_over,
                       help="a decode worker moved to prefill hands its running requests to "
                            "the other decode workers, where they resume; without it, it "
                            "finishes them first")
    group.add_argument("--controller-profile", default=c.profile,
                       help="latency profile JSON (pdserve profile) whose step models the "
                            "controller uses until it has fitted its own")


def controller_argv(args: argparse.Namespace) -> list[str]:
    """The controller flags of `args` as command-line arguments (for `pdserve up`)."""
    return ["--controller", args.controller, "--slo-ttft-ms", str(args.slo_ttft_ms),
            "--slo-tpot-ms", str(args.slo_tpot_ms),
            "--controller-interval-s", str(args.controller_interval_s),
            "--controller-min-gain", str(args.controller_min_gain),
            "--controller-window-s", str(args.controller_window_s),
            "--controller-cooldown-s", str(args.controller_cooldown_s),
            "--controller-hand-over" if args.controller_hand_over
            else "--no-controller-hand-over",
            *(["--controller-profile", args.controller_profile]
              if args.controller_profile else [])]


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        model=args.model, served_model_name=args.served_model_name, host=args.host,
        port=args.port, prefill_addrs=tuple(args.prefill), decode_addrs=tuple(args.decode),
        colocated_addrs=tuple(args.colocated), store_master_addr=args.store_master,
        api_key=args.api_key, ops_need_api_key=args.ops_need_api_key,
        max_model_len=args.max_model_len, max_request_bytes=args.max_request_bytes,
        default_max_tokens=args.default_max_tokens, max_tokens_ceiling=args.max_tokens_ceiling,
        supervisor_state_file=args.supervisor_state_file,
        max_inflight_per_worker=args.max_inflight_per_worker,
        max_predicted_ttft_s=args.max_predicted_ttft_s,
        first_token_timeout_s=args.first_token_timeout_s, token_timeout_s=args.token_timeout_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s, max_migrations=args.max_migrations,
        pool_wait_s=args.pool_wait_s,
        max_pool_waiters=args.max_pool_waiters, prefill_routing=args.prefill_routing,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        controller=ControllerConfig(
            mode=args.controller, ttft_slo_s=args.slo_ttft_ms / 1000,
            tpot_slo_s=args.slo_tpot_ms / 1000, interval_s=args.controller_interval_s,
            min_gain=args.controller_min_gain, window_s=args.controller_window_s,
            cooldown_s=args.controller_cooldown_s, hand_over=args.controller_hand_over,
            profile=args.controller_profile),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        discovery=args.discovery, discovery_ttl_s=args.discovery_ttl_s,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pdserve.ports import check_port_free
    from pdserve.router.app import build_app

    # The handlers go in before anything binds: a SIGTERM while the router starts (a
    # supervisor stopping it) stops it cleanly instead of killing it with the default action.
    # While uvicorn serves, its own handlers stand in for these; when it stops it restores
    # them and raises the signal it caught again, which lands here (the default action would
    # end a router that shut down gracefully with -SIGTERM).
    stop_asked = threading.Event()
    servers: list[uvicorn.Server] = []

    def shut_down(signum: int, _frame: object) -> None:
        if not stop_asked.is_set():
            logger.info("router: signal %d, shutting down", signum)
        stop_asked.set()
        if servers:
            servers[0].should_exit = True

    signal.signal(signal.SIGINT, shut_down)
    signal.signal(signal.SIGTERM, shut_down)
    try:
        config = config_from_args(args)
        check_port_free(config.host, config.port)  # PortInUse names who holds it
        if config.discovery is not None:
            discovery.check_reachable(discovery.DiscoveryURL.parse(config.discovery))
        app = build_app(config)
    except (ValueError, FileNotFoundError, OSError, discovery.DiscoveryError) as exc:
        logger.error("cannot start the router: %s", exc)
        return 2
    if stop_asked.is_set():  # asked while the app was built: bind nothing
        app.state.serving.close()
        return 0
    logger.info("router on http://%s:%d/v1", config.host, config.port)
    lifecycle.freeze_startup_heap("router")  # (the app and its tokenizer are built)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    servers.append(server)
    server.should_exit = stop_asked.is_set()  # (asked meanwhile: it stops once started)
    server.run()
    if not server.started and not stop_asked.is_set():  # (uvicorn.run's exit code)
        logger.error("the router did not start on %s:%d", config.host, config.port)
        return 3
    return 0
