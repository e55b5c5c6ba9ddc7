"""Router configuration (one frozen dataclass; `pdserve router` flags take defaults from it)."""

from __future__ import annotations

from dataclasses import dataclass, field

CONTROLLER_MODES = ("off", "recommend", "flip")


@dataclass(frozen=True)
class ControllerConfig:
    mode: str = "recommend"
    """off: nothing; recommend: publish the best split; flip: also move workers to it."""
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    attainment: float = 0.9
    interval_s: float = 5.0
    min_gain: float = 1.2
    """Flip only when the best split's goodput is at least this times the current one's."""
    patience: int = 3
    """...for this many ticks in a row."""
    cooldown_s: float = 30.0
    """No flip within this long after the last one (its effect must show in the samples)."""
    drain_timeout_s: float = 60.0
    """A worker that does not drain within this keeps its role and rejoins its pool."""
    window_requests: int = 1000
    window_samples: int = 2000

    def __post_init__(self) -> None:
        if self.mode not in CONTROLLER_MODES:
            raise ValueError(
                f"controller mode must be one of {CONTROLLER_MODES}, got {self.mode!r}")
        for name in ("ttft_slo_s", "tpot_slo_s", "interval_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 < self.attainment <= 1:
            raise ValueError("attainment must be in (0, 1]")
        if self.min_gain < 1 or self.patience < 1:
            raise ValueError("min_gain must be >= 1 and patience >= 1")



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
    max_model_len: int | None = None
    """Prompt + output token limit; None takes the checkpoint's max_position_embeddings.
    Either way the smallest limit a worker reports (its KV pool caps it) wins."""
    default_max_tokens: int | None = 16
    """max_tokens of a /v1/completions request that gives none (OpenAI's and vLLM's 16),
    capped to the room left in the context; None: the room left. A chat request without
    max_tokens always gets the room left (vLLM)."""
    max_inflight_per_worker: int = 256
    """Admission: requests one worker may hold before new ones get HTTP 429."""
    max_predicted_ttft_s: float | None = None
    """Admission: reject with 429 when the predicted TTFT exceeds this."""
    first_token_timeout_s: float = 120.0
    """Longest wait for a worker's first output before the request fails."""
    token_timeout_s: float = 60.0
    """Longest wait between two outputs of a running request."""
    heartbeat_timeout_s: float = 30.0
    """A worker silent this long is hung: its requests fail (or move, if nothing was sent).
    A worker whose connection drops (it died) is failed at once, without this wait."""
    max_request_bytes: int = 8 * 1024 * 1024
    """Bodies larger than this get HTTP 413."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The goodput-aware prefill:decode controller (disaggregated mode only)."""
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.prefill_addrs and self.decode_addrs) and not self.colocated_addrs:
            raise ValueError(
                "the router needs colocated workers, or both prefill and decode workers"
            )
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        for name in ("first_token_timeout_s", "token_timeout_s", "heartbeat_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.prefill_addrs and self.decode_addrs)
