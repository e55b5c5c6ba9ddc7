"""Router configuration (one frozen dataclass; `pdserve router` flags take defaults from it)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pdserve.discovery import DEFAULT_TTL_S, DiscoveryURL, check_ttl
from pdserve.router.tool_parsers import TOOL_CALL_PARSERS

CONTROLLER_MODES = ("off", "recommend", "flip")


def check_otlp_traces_endpoint(endpoint: str) -> None:
    """Raise ValueError unless `endpoint` is an http(s) URL (traces go over OTLP/HTTP)."""
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", endpoint):
        raise ValueError("the OTLP traces endpoint must be an http:// or https:// URL (OTLP "
                         f"over HTTP), got {endpoint[:80]!r}")


@dataclass(frozen=True)
class ControllerConfig:
    mode: str = "recommend"
    """off: nothing; recommend: publish the best split; flip: also move workers to it."""
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    attainment: float = 0.9
    interval_s: float = 5.0
    min_gain: float = 1.2
    """Headroom: the current split stays while its capacity is at least this times the
    arriving rate (and it meets the target); a move needs this times its capacity..."""
    min_attainment_gain: float = 0.05
    """...or this much more predicted attainment."""
    patience: int = 1
    """Move only when the same split is wanted this many ticks in a row."""
    cooldown_s: float = 10.0
    """No move within this long after the last one ends: its effect shows in the queues and
    the samples first (and without hand-over, the moved workers drain meanwhile)."""
    drain_timeout_s: float = 60.0
    """A worker that does not drain within this keeps its role and rejoins its pool."""
    hand_over: bool = True
    """A decode worker that moves hands its running requests to the other decode workers
    (they resume there) instead of finishing them first (pdserve/router/moves.py)."""
    window_s: float = 10.0
    """The arriving load is what arrived in the last this many seconds."""
    max_pool_workers: int = 64
    """The largest pool the fleet size it publishes may ask for."""
    window_requests: int = 1000
    window_samples: int = 2000
    profile: str | None = None
    """A latency profile (docs/planner.md) to start from: its step models stand in for a
    phase until the workers have reported enough steps of it to fit one."""

    def __post_init__(self) -> None:
        if self.mode not in CONTROLLER_MODES:
            raise ValueError(
                f"controller mode must be one of {CONTROLLER_MODES}, got {self.mode!r}")
        for name in ("ttft_slo_s", "tpot_slo_s", "interval_s", "drain_timeout_s", "window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 < self.attainment <= 1:
            raise ValueError("attainment must be in (0, 1]")
        if self.cooldown_s < 0:
            raise ValueError("cooldown_s must be >= 0")
        if self.min_gain < 1 or self.patience < 1 or not 0 <= self.min_attainment_gain <= 1:
            raise ValueError("min_gain must be >= 1, patience >= 1 and min_attainment_gain "
                             "in [0, 1]")



@dataclass(frozen=True)
class RouterConfig:
    model: str
    """Local checkpoint directory: the router reads its tokenizer, chat template and config."""
    served_model_name: str | None = None
    """Name clients put in `model`; None takes the directory's base name."""
    host: str = "127.0.0.1"
    port: int = 8000
    prefill_addrs: tuple[str, ...] = ()
    """ZeroMQ addresses of prefill workers (tcp://host:port)."""
    decode_addrs: tuple[str, ...] = ()
    """ZeroMQ addresses of decode workers."""
    colocated_addrs: tuple[str, ...] = ()
    """ZeroMQ addresses of colocated workers (prefill and decode in one)."""
    store_master_addr: str | None = None
    """The KV store master's control address, for prefix lookups (None: no lookups)."""
    api_key: str | None = None
    """When set, every /v1 request needs `Authorization: Bearer <api_key>`."""
    ops_need_api_key: bool = False
    """/metrics and /status need the API key too (/health stays open for liveness probes)."""
    max_model_len: int | None = None
    """Prompt + output token limit; None takes the checkpoint's max_position_embeddings.
    Either way the smallest limit a worker reports (its KV pool caps it) wins."""
    default_max_tokens: int | None = None
    """max_tokens of a request that gives none (chat and completions), capped to the room
    left in the context. None: OpenAI's and vLLM's rule, 16 for /v1/completions and the
    room left for a chat request (either capped by max_tokens_ceiling)."""
    max_tokens_ceiling: int | None = None
    """The most tokens one request may generate: a larger explicit max_tokens is a 400, and
    a request without one gets no more (None: the context is the only limit)."""
    max_inflight_per_worker: int = 256
    """Admission: requests one worker may hold before new ones get HTTP 429."""
    max_predicted_ttft_s: float | None = None
    """Admission: reject with 429 when the predicted TTFT exceeds this."""
    first_token_timeout_s: float = 120.0
    """Longest wait for a worker's first output before the request fails."""
    token_timeout_s: float = 60.0
    """Longest wait between two outputs of a running request."""
    heartbeat_timeout_s: float = 30.0
    """A worker silent this long is hung: its requests move to another worker (see
    max_migrations). A worker whose connection drops (it died) is failed at once, without
    this wait."""
    max_migrations: int = 2
    """How many times one request may move off a worker that died or hung
    (pdserve/router/dispatch.py: the same request before any output, prompt + outputs so far after);
    past it, or with no other worker of the pool ready, the client gets the error."""
    pool_wait_s: float = 15.0
    """A request whose pool has no ready worker (both prefill workers restarting, say) waits
    this long for one before it gets HTTP 503; a migration waits the same. A little over a
    worker's restart (6.4-7.4 s measured on 2 cores); 0: refuse at once."""
    max_pool_waiters: int = 1024
    """At most this many requests wait so at once; the next gets HTTP 503 at once."""
    local_prefill_max_tokens: int = 0
    """Disaggregated mode: a prompt with at most this many tokens not cached on a decode
    worker with headroom is computed on that decode worker instead of a prefill worker
    (pdserve/router/placement.py); 0: every prompt goes to a prefill worker."""
    prefill_routing: str = "cache-aware"
    """How a prefill (or colocated) worker is picked (pdserve/router/policies.py
    PREFILL_ROUTING): cache-aware (the prefix it or the store holds, less a load penalty),
    least-load, round-robin."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Bodies larger than this get HTTP 413."""
    supervisor_state_file: str | None = None
    """JSON file where `pdserve up` keeps its children's restart counts, exported in /metrics
    as pdserve:process_restarts_total (None: not under a launcher)."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The goodput-aware prefill:decode controller (disaggregated mode only)."""
    otlp_traces_endpoint: str | None = None
    """Where each request's trace goes, OTLP over HTTP/protobuf (e.g.
    http://localhost:4318/v1/traces, used as given); None: no tracing
    (pdserve/router/tracing.py)."""
    enable_auto_tool_choice: bool = False
    """Serve tool_choice "auto" (and tools without a tool_choice) by parsing the model's text
    for calls with tool_call_parser (vLLM's --enable-auto-tool-choice); off: those are 400s."""
    tool_call_parser: str | None = None
    """The model family's tool-call format (pdserve/router/tool_parsers.py: hermes, llama3_json,
    mistral, deepseek_v3)."""
    discovery: str | None = None
    """etcd://HOST:PORT[/CLUSTER]: register this router and watch the registry, adding and
    dropping workers (and the store master) live (pdserve/router/fleet_watch.py,
    pdserve/discovery.py). Static worker addresses, when also given, stay in their pools."""
    discovery_ttl_s: float = DEFAULT_TTL_S
    """The router's own registry lease TTL."""
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.discovery is not None:
            DiscoveryURL.parse(self.discovery)  # ValueError names the expected form
            check_ttl(self.discovery_ttl_s)
        elif not (self.prefill_addrs and self.decode_addrs) and not self.colocated_addrs:
            raise ValueError(
                "the router needs colocated workers, or both prefill and decode workers, "
                "or --discovery to find them"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("first_token_timeout_s", "token_timeout_s", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        if not 0 <= self.pool_wait_s < float("inf"):
            raise ValueError("pool_wait_s must be >= 0")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")
        if self.max_pool_waiters < 0:
            raise ValueError("max_pool_waiters must be >= 0")
        if self.prefill_routing not in ("cache-aware", "least-load", "round-robin"):
            raise ValueError(f"unknown prefill routing {self.prefill_routing!r}")
        for name in ("default_max_tokens", "max_tokens_ceiling"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 when set")
        if (self.default_max_tokens is not None and self.max_tokens_ceiling is not None
                and self.default_max_tokens > self.max_tokens_ceiling):
            raise ValueError("default_max_tokens must not exceed max_tokens_ceiling")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be positive")
        if self.ops_need_api_key and self.api_key is None:
            raise ValueError("ops_need_api_key needs an api_key")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.otlp_traces_endpoint is not None:
            check_otlp_traces_endpoint(self.otlp_traces_endpoint)

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.prefill_addrs and self.decode_addrs)
