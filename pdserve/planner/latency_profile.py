"""A latency profile: the fitted step-time models of one model on one kind of hardware, per
TP degree, as the planner reads them and the controller exports them (docs/planner.md).

    {"model": "...", "hardware": "...", "kv_bytes_per_token": 131072,
     "prefill": {"1": {"intercept_s": a, "per_token_s": b, "per_attention_s": c}, ...},
     "decode":  {"1": {"intercept_s": a, "per_context_token_s": b, "per_sequence_s": c}, ...}}

    prefill step = a + b·(tokens in the batch) + c·(Σ over its prompts of q_len·k_len)
    decode step  = a + b·(context tokens read) + c·(sequences in the batch)

Optional top-level fields: kv_transfer_bytes_per_s (between the pools), max_num_batched_tokens
and max_num_seqs (an instance's batch limits), handoff_s and ttft_overhead_s (fixed times the
simulation adds, SimulationConfig), source (where the numbers come from). Optional per entry:
num_samples and rel_error (how good the fit is). Times are in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.planner.goodput_model import LinearLatency, PhaseModels, SimulationConfig

PREFILL_TERMS = ("per_token_s", "per_attention_s")
DECODE_TERMS = ("per_context_token_s", "per_sequence_s")
_OPTIONAL_NUMBERS = (
    "kv_transfer_bytes_per_s",
    "max_num_batched_tokens",
    "max_num_seqs",
    "handoff_s",
    "ttft_overhead_s",
)


class ProfileError(ValueError):
    """A profile file is missing, malformed, or lacks the TP degree asked for."""


@dataclass(frozen=True)
class LatencyProfile:
    model: str
    hardware: str
    kv_bytes_per_token: int
    prefill: Mapping[int, LinearLatency]
    """TP degree -> prefill step model, features (tokens, Σ q_len·k_len)."""
    decode: Mapping[int, LinearLatency]
    """TP degree -> decode step model, features (context tokens, sequences)."""
    kv_transfer_bytes_per_s: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    handoff_s: float | None = None
    ttft_overhead_s: float | None = None
    source: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Other top-level fields, kept through a round trip (measurement settings, notes)."""

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ProfileError("a profile needs at least one prefill and one decode entry")
        if self.kv_bytes_per_token < 0:
            raise ProfileError("kv_bytes_per_token must be >= 0")
        for phase in (self.prefill, self.decode):
            for tp, model in phase.items():
                if tp < 1:
                    raise ProfileError(f"TP degree {tp} must be >= 1")
                terms = (model.intercept, *model.coefs)
                if len(model.coefs) != 2 or not all(math.isfinite(t) and t >= 0 for t in terms):
                    raise ProfileError(f"TP {tp}: every time term must be finite and >= 0")
                if model(1, 1) <= 0:
                    raise ProfileError(f"TP {tp}: a step must take some time")
        if self.kv_transfer_bytes_per_s is not None and self.kv_transfer_bytes_per_s <= 0:
            raise ProfileError("kv_transfer_bytes_per_s must be > 0")

    def models(self, prefill_tp: int, decode_tp: int) -> PhaseModels:
        if prefill_tp not in self.prefill or decode_tp not in self.decode:
            raise ProfileError(
                f"the profile has prefill TP {sorted(self.prefill)} and decode TP "
                f"{sorted(self.decode)}; asked for prefill TP {prefill_tp}, decode TP "
                f"{decode_tp}"
            )
        return PhaseModels(self.prefill[prefill_tp], self.decode[decode_tp])

    def simulation_config(self, base: SimulationConfig) -> SimulationConfig:
        """`base` with what the profile knows: the batch limits, the fixed times, and the
        KV transfer rate that turns a prompt's KV bytes into hand-off time."""
        changes: dict[str, Any] = {}
        if self.max_num_batched_tokens:
            changes["max_batched_tokens"] = self.max_num_batched_tokens
        if self.max_num_seqs:
            changes["max_num_seqs"] = self.max_num_seqs
        if self.handoff_s is not None:
            changes["handoff_s"] = self.handoff_s
        if self.ttft_overhead_s is not None:
            changes["ttft_overhead_s"] = self.ttft_overhead_s
        if self.kv_transfer_bytes_per_s:
            changes["kv_transfer_s_per_token"] = (
                self.kv_bytes_per_token / self.kv_transfer_bytes_per_s
            )
        return dataclasses.replace(base, **changes)

    # ---- the JSON form ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "hardware": self.hardware,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }
        if self.source is not None:
            out["source"] = self.source
        out["prefill"] = {
            str(tp): _entry(m, PREFILL_TERMS) for tp, m in sorted(self.prefill.items())
        }
        out["decode"] = {str(tp): _entry(m, DECODE_TERMS) for tp, m in sorted(self.decode.items())}
        for name in _OPTIONAL_NUMBERS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyProfile:
        try:
            known = {
                "model",
                "hardware",
                "kv_bytes_per_token",
                "prefill",
                "decode",
                "source",
                *_OPTIONAL_NUMBERS,
            }
            optional = {name: data.get(name) for name in _OPTIONAL_NUMBERS}
            for name in ("max_num_batched_tokens", "max_num_seqs"):
                if optional[name] is not None:
                    optional[name] = int(optional[name])
            return cls(
                model=str(data["model"]),
                hardware=str(data["hardware"]),
                kv_bytes_per_token=int(data["kv_bytes_per_token"]),
                prefill={int(tp): _model(e, PREFILL_TERMS) for tp, e in data["prefill"].items()},
                decode={int(tp): _model(e, DECODE_TERMS) for tp, e in data["decode"].items()},
                source=data.get("source"),
                **optional,
                extra={k: v for k, v in data.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ProfileError):
                raise
            raise ProfileError(f"not a latency profile: {type(exc).__name__}: {exc}") from exc

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {path} is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ProfileError(f"profile {path} is not a JSON object")
        return cls.from_dict(data)


BUNDLED_DIR = Path(__file__).parent / "profiles"
"""Published profiles shipped with pdserve, each with its source (loaded by name)."""


def bundled_profiles() -> list[str]:
    return sorted(path.stem for path in BUNDLED_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> LatencyProfile:
    """A profile from a JSON file, or one of bundled_profiles() by name."""
    path = Path(name_or_path)
    if not path.exists() and path.suffix == "" and path.name in bundled_profiles():
        path = BUNDLED_DIR / f"{path.name}.json"
    elif not path.exists():
        raise ProfileError(f"no profile file {str(name_or_path)!r} (bundled ones: "
                           f"{', '.join(bundled_profiles())})")
    return LatencyProfile.load(path)


def _entry(model: LinearLatency, names: tuple[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"intercept_s": model.intercept}
    out.update(zip(names, model.coefs, strict=True))
    if model.num_samples:
        out["num_samples"] = model.num_samples
        out["rel_error"] = round(model.rel_error, 4)
    return out


def _model(entry: Mapping[str, Any], names: tuple[str, str]) -> LinearLatency:
    return LinearLatency(
        float(entry["intercept_s"]),
        tuple(float(entry[n]) for n in names),
        int(entry.get("num_samples", 0)),
        float(entry.get("rel_error", 0.0)),
    )
