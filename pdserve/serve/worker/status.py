"""What a worker's status reports beyond its engine's counters: its tiers' totals, the CPU
path it serves with, the MoE experts' load (pdserve/serve/worker/server.py Worker.status)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.serve.worker.kv_transfer import KVTransfer


def _kv_tiers(engine, kv_transfer: KVTransfer | None) -> dict[str, float]:
    """WorkerStatus.kv_tiers: the pool's own hits, the host tier's numbers, the store's."""
    tiers = {"device_hit_tokens": float(getattr(engine.scheduler, "num_device_hit_tokens", 0))}
    offload = getattr(engine, "kv_offload", None)
    if offload is not None:
        tiers.update(offload.as_status())
    if kv_transfer is not None:
        totals = kv_transfer.totals()
        tiers["store_hit_tokens"] = totals["store_hit_tokens"]
        tiers["store_read_bytes"] = totals["store_read_bytes"]
    return tiers


def _cpu_path(engine) -> dict[str, str]:
    status = getattr(engine.runner, "cpu_path_status", None)  # a test's fake runner: none
    return status() if status is not None else {}


def _sim(engine) -> dict[str, str]:
    stats = getattr(engine.runner, "sim_stats", None)  # the simulated engine only
    return {k: str(v) for k, v in stats().items()} if stats is not None else {}


def _moe_load(engine) -> dict[str, object]:
    load = getattr(engine.runner, "moe_load", lambda: None)()  # a test's fake runner: none
    if load is None:
        return {}
    routed, dropped = load
    return {"moe_expert_tokens": routed, "moe_dropped_tokens": dropped}


def _mean_seconds(samples: list) -> float:
    return sum(s.seconds for s in samples) / len(samples) if samples else 0.0


# ---- the command ---------------------------------------------------------------------------
