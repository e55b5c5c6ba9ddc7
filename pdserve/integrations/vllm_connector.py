"""vLLM's KV connector over pdserve's store: vLLM instances save and load KV blocks in the
tiered, fleet-wide store (and through the prefix index) that pdserve's own workers use.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PdserveConnector",
        "kv_connector_module_path": "pdserve.integrations.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "tcp://H:7601", "store_master": "tcp://H:7600"}}'

vLLM (v1 connector API) runs a connector twice: once in its scheduler, once in each worker.

    scheduler process                                  worker process (the model runner)
    get_num_new_matched_tokens  master lookup          register_kv_caches   pool views
    update_state_after_alloc    pin, plan the load     start_load_kv        fetch, copy in
    build_connector_meta  ──── StepPlan ────────────►  wait_for_layer_load  per layer
                               (loads, saves)          save_kv_layer        copy out, put
    request_finished            forget the request     wait_for_save        failed blocks

Keys. A vLLM block of B tokens is named by pdserve's chain (pdserve/kvstore/block_key.py), whose
root folds in the model identity, the KV layout (dtype, B, layers, KV heads, head_dim) and the
request's cache_salt: vLLM's blocks and a pdserve worker's match only when all of those are
equal, and then they hold the same bytes, since a stored block is always pdserve's layout
([num_layers, 2, B, num_kv_heads, head_dim], pdserve/kvstore/connector.py), whatever the engine's
paged layout is.

Scheduler (vllm_scheduler.py). The prompt's full blocks (all but its last token: vLLM must
compute one token to sample) are looked up at the master; the leading run that the
connector's own data node holds is the hit, so the worker reads nothing it cannot reach. The
hit's blocks are pinned under a lease until the worker has read them (a block evicted anyway
is a failed load, below). Each step's plan names the loads (keys -> vLLM block ids) and the
saves: every prompt block this step completes that the store did not already hold.

Worker (vllm_worker.py). Each of vLLM's per-layer cache tensors is viewed, without a copy, as
pdserve's pool layout [2, num_blocks, B, H, D] (CPU_ATTN stores K transposed; the view undoes
it), so pdserve's StoreConnector moves the blocks: one background thread fetches a step's blocks
and copies them in layer by layer while the forward waits on each layer in turn
(wait_for_layer_load); a save copies each layer's blocks out as the layer finishes, and the put
runs off the critical path.

This module is what vLLM loads: the configuration (kv_connector_extra_config) and the two
vLLM classes, thin adapters from vLLM's objects to those two halves.

Loads are synchronous to vLLM (the step that needs them waits), and the KV cache is a cache:
a block that did not arrive (store down, evicted, malformed) is reported through
get_block_ids_with_load_errors, vLLM's failure path. Under kv_load_failure_policy "recompute"
vLLM recomputes from the first failed block and drops the step's output for the request, so a
failed load never changes the text; under its default, "fail", the request ends with an error
(never with wrong text): set "recompute" (the connector warns when it is not).

Security. The store's sockets run CurveZMQ under the cluster key (pdserve/security.py): the
connector uses `cluster_key_file`, else PDSERVE_CLUSTER_KEY_FILE, and talks plaintext only when
asked (`insecure_plaintext`, or PDSERVE_INSECURE_PLAINTEXT=1); otherwise vLLM fails to start.

vLLM is imported lazily (module __getattr__ builds PdserveConnector on first access): pdserve
does not depend on vLLM, and the pure parts (config, keys, plans, views) test without it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from pdserve import security
from pdserve.integrations.vllm_scheduler import PdserveScheduler, ScheduledRequest, StepPlan
from pdserve.integrations.vllm_worker import POOL_VIEWS, PdserveWorker
from pdserve.kvstore.block_key import KVLayout
from pdserve.kvstore.client import StoreClient

logger = logging.getLogger(__name__)

TRANSPORTS = ("zmq", "ucx")
_TCP_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}")


# ---- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PdserveConnectorConfig:
    """kv_connector_extra_config of vLLM's --kv-transfer-config."""

    store: str
    """tcp://host:port of the data server blocks are read from and written to."""
    store_master: str | None = None
    """tcp://host:port of the store master (fleet-wide prefix lookups); None: ask `store`."""
    model_id: str | None = None
    """Model identity in the key root; None: vLLM's served model name, else the checkpoint
    directory's name (what pdserve's workers use, so equal layouts share blocks)."""
    timeout_s: float = 5.0
    """Every store request gives up after this long (the KV cache then counts a miss)."""
    transport: str = "zmq"
    """KV bytes over ZeroMQ, or UCX (ucxx; falls back to ZeroMQ with a WARNING)."""
    lease_ttl_s: float = 30.0
    """Pin a hit's blocks from lookup until the worker read them, for at most this long
    (0: no pin)."""
    cluster_key_file: str | None = None
    """The cluster key file; None: PDSERVE_CLUSTER_KEY_FILE."""
    insecure_plaintext: bool = False
    """Talk to the store without CurveZMQ (or PDSERVE_INSECURE_PLAINTEXT=1)."""

    def __post_init__(self) -> None:
        for name in ("store", "store_master"):
            address = getattr(self, name)
            if address is not None and not _TCP_ADDRESS.fullmatch(address):
                raise ValueError(f"kv_connector_extra_config.{name} must be tcp://host:port, "
                                 f"got {address!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.timeout_s <= 0 or self.lease_ttl_s < 0:
            raise ValueError("timeout_s must be positive and lease_ttl_s >= 0")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> PdserveConnectorConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: "
                             f"{sorted(known)}")
        if not extra.get("store"):
            raise ValueError("kv_connector_extra_config needs 'store': the tcp://host:port of "
                             "a pdserve store data server")
        values = dict(extra)
        for name in ("timeout_s", "lease_ttl_s"):
            if name in values:
                values[name] = float(values[name])
        if "insecure_plaintext" in values:
            values["insecure_plaintext"] = _as_bool(values["insecure_plaintext"])
        return cls(**values)

    def cluster_key(self) -> security.ClusterKey | None:
        """The key the store's sockets need; None only when plaintext was asked for. Raises
        ClusterKeyError when there is neither."""
        path = self.cluster_key_file or os.environ.get(security.KEY_FILE_ENV)
        if path:
            return security.ClusterKey.load(path)
        if self.insecure_plaintext or os.environ.get(security.PLAINTEXT_ENV) == "1":
            logger.warning("INSECURE: the vLLM connector talks to the pdserve store in "
                           "PLAINTEXT; give it the cluster key (cluster_key_file or %s)",
                           security.KEY_FILE_ENV)
            return None
        raise security.ClusterKeyError(
            f"no cluster key for the pdserve store: set kv_connector_extra_config."
            f"cluster_key_file or {security.KEY_FILE_ENV}, or ask for plaintext "
            f"(insecure_plaintext: true, or {security.PLAINTEXT_ENV}=1)")

    def open_client(self, key: security.ClusterKey | None, with_master: bool = True,
                    transport: str | None = None) -> StoreClient:
        """A StoreClient of this store, its sockets made under `key`."""
        with security.using(key):
            return StoreClient(self.store, self.store_master if with_master else None,
                               transport=transport or self.transport, timeout_s=self.timeout_s)


def _as_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
        return value.lower() in ("1", "true", "yes")
    raise ValueError(f"expected a boolean, got {value!r}")


def model_identity(model: str, served_model_name: str | Sequence[str] | None) -> str:
    """The model part of the key root: the served name when one was given, else the
    checkpoint directory's name (as pdserve names a served directory)."""
    if isinstance(served_model_name, (list, tuple)):
        served_model_name = served_model_name[0] if served_model_name else None
    if served_model_name and served_model_name != model:
        return str(served_model_name)
    return Path(model).name or model


# ---- vLLM's classes, built on first access ----------------------------------------------------

_VLLM_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """PdserveConnector and PdserveConnectorMetadata subclass vLLM's bases: build them when
    first asked for (by vLLM's connector factory, or pickle), so importing this module never
    imports vLLM."""
    if name in ("PdserveConnector", "PdserveConnectorMetadata"):
        if not _VLLM_CLASSES:
            _VLLM_CLASSES.update(_build_vllm_classes())
        return _VLLM_CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def vllm_kv_layout(vllm_config: Any) -> KVLayout:
    """The KV layout of a vLLM model (the root's layout part)."""
    model_config = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise NotImplementedError(f"the pdserve connector stores the model dtype's KV, not "
                                  f"kv_cache_dtype {cache_dtype!r}")
    if getattr(model_config, "use_mla", False):
        raise NotImplementedError("the pdserve connector does not move vLLM's MLA cache yet")
    return KVLayout(dtype=str(model_config.dtype).removeprefix("torch."),
                    block_size=vllm_config.cache_config.block_size,
                    num_layers=model_config.get_num_layers(vllm_config.parallel_config),
                    num_kv_heads=model_config.get_total_num_kv_heads(),
                    head_dim=model_config.get_head_size())


def scheduled_requests(scheduler_output: Any) -> list[ScheduledRequest]:
    """The plan's view of vLLM's SchedulerOutput (group 0 blocks: one KV cache group)."""
    num_scheduled = scheduler_output.num_scheduled_tokens
    out = [ScheduledRequest(r.req_id, r.num_computed_tokens, num_scheduled.get(r.req_id, 0),
                            list(r.block_ids[0]), True)
           for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    for i, request_id in enumerate(cached.req_ids):
        new_blocks = cached.new_block_ids[i]
        out.append(ScheduledRequest(
            request_id, cached.num_computed_tokens[i], num_scheduled.get(request_id, 0),
            list(new_blocks[0]) if new_blocks is not None else [],
            request_id in cached.resumed_req_ids))
    return out


def _route_logs_to_vllm() -> None:
    """Inside vLLM, pdserve's loggers (the connector's, the store client's) write through
    vLLM's handlers: nothing else configures them there, and their INFO lines would be lost."""
    vllm_logger, pdserve_logger = logging.getLogger("vllm"), logging.getLogger("pdserve")
    if not pdserve_logger.handlers and vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            pdserve_logger.addHandler(handler)
        pdserve_logger.setLevel(logging.INFO)
        pdserve_logger.propagate = False


def _build_vllm_classes() -> dict[str, type]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    _route_logs_to_vllm()

    class PdserveConnectorMetadata(KVConnectorMetadata):
        """The StepPlan, as vLLM carries it from scheduler to workers."""

        def __init__(self, plan: StepPlan) -> None:
            self.plan = plan

    class PdserveConnector(KVConnectorBase_V1):
        """vLLM's KV connector over pdserve's store (see the module docstring)."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config=vllm_config, role=role,
                             kv_cache_config=kv_cache_config)
            transfer = self._kv_transfer_config
            self.config = PdserveConnectorConfig.from_extra_config(
                transfer.kv_connector_extra_config or {})
            if vllm_config.parallel_config.pipeline_parallel_size > 1:
                raise NotImplementedError("the pdserve connector needs pipeline parallel 1")
            groups = getattr(kv_cache_config, "kv_cache_groups", None)
            if groups is not None and len(groups) > 1:
                raise NotImplementedError("the pdserve connector needs one KV cache group "
                                          "(full attention in every layer)")
            self.layout = vllm_kv_layout(vllm_config)
            model_config = vllm_config.model_config
            self.model_id = self.config.model_id or model_identity(
                model_config.model, model_config.served_model_name)
            key = self.config.cluster_key()
            tp_size = vllm_config.parallel_config.tensor_parallel_size
            self.scheduler: PdserveScheduler | None = None
            self.worker: PdserveWorker | None = None
            if role == KVConnectorRole.SCHEDULER:
                if transfer.is_kv_producer and tp_size > 1:
                    raise NotImplementedError("saving to the pdserve store needs TP 1 "
                                              "(a stored block holds every KV head)")
                client = self.config.open_client(key, transport="zmq")  # control verbs only
                self.scheduler = PdserveScheduler(
                    self.layout, self.model_id, client, can_load=transfer.is_kv_consumer,
                    can_save=transfer.is_kv_producer, lease_ttl_s=self.config.lease_ttl_s,
                    data_address=self.config.store)
                if transfer.is_kv_consumer and transfer.kv_load_failure_policy != "recompute":
                    logger.warning("pdserve connector: kv_load_failure_policy is %r: a block "
                                   "that fails to load fails its request; 'recompute' "
                                   "recomputes it instead", transfer.kv_load_failure_policy)
                logger.info("pdserve connector (%s): store %s, model %r, layout %s",
                            transfer.kv_role, self.config.store, self.model_id, self.layout)
            else:
                tp_rank = 0
                if tp_size > 1:
                    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
                    tp_rank = get_tensor_model_parallel_rank()
                client = self.config.open_client(key, with_master=False)
                self.worker = PdserveWorker(self.layout, client, tp_rank, tp_size,
                                            self.config.timeout_s)

        @property
        def requires_kv_delivery(self) -> bool:
            """No: the store is a cache, and a save that never happens is a later miss."""
            return False

        # ---- worker side ---------------------------------------------------------------
        def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
            assert self.worker is not None
            layers = self._vllm_config.compilation_config.static_forward_context
            kinds = {(layers[name].attn_backend.get_name(), getattr(layers[name], "isa", None))
                     for name in kv_caches if hasattr(layers.get(name), "attn_backend")}
            if len(kinds) != 1 or next(iter(kinds)) not in POOL_VIEWS:
                raise NotImplementedError(f"the pdserve connector reads the KV layouts of "
                                          f"(backend, ISA) {sorted(POOL_VIEWS)}, not "
                                          f"{sorted(kinds, key=str)}")
            self.worker.register(kv_caches, POOL_VIEWS[kinds.pop()])

        def _plan(self) -> StepPlan:
            metadata = self._get_connector_metadata()
            assert isinstance(metadata, PdserveConnectorMetadata)
            return metadata.plan

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            assert self.worker is not None
            self.worker.start_loads(self._plan())

        def wait_for_layer_load(self, layer_name: str) -> None:
            assert self.worker is not None
            self.worker.wait_for_layer(layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                          attn_metadata: Any, **kwargs: Any) -> None:
            assert self.worker is not None
            self.worker.save_layer(layer_name, self._plan())

        def wait_for_save(self) -> None:
            assert self.worker is not None
            self.worker.finish_step()

        def get_block_ids_with_load_errors(self) -> set[int]:
            return self.worker.take_invalid_block_ids() if self.worker is not None else set()

        # ---- scheduler side ------------------------------------------------------------
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                       ) -> tuple[int, bool]:
            assert self.scheduler is not None
            if request.prompt_token_ids is None:  # prompt embeddings: no token keys
                return 0, False
            num = self.scheduler.num_new_matched_tokens(
                request.request_id, list(request.all_token_ids), len(request.prompt_token_ids),
                num_computed_tokens, getattr(request, "cache_salt", None))
            return num, False  # loaded synchronously, in the step that needs them

        def update_state_after_alloc(self, request: Any, blocks: Any,
                                     num_external_tokens: int) -> None:
            assert self.scheduler is not None
            if num_external_tokens > 0:
                self.scheduler.update_after_alloc(request.request_id, blocks.get_block_ids()[0],
                                                  num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> PdserveConnectorMetadata:
            assert self.scheduler is not None
            return PdserveConnectorMetadata(
                self.scheduler.build_plan(scheduled_requests(scheduler_output)))

        def request_finished(self, request: Any, block_ids: list[int]
                             ) -> tuple[bool, dict[str, Any] | None]:
            if self.scheduler is not None:
                self.scheduler.request_finished(request.request_id)
            return False, None

        def shutdown(self) -> None:
            if self.worker is not None:
                self.worker.drain(self.config.timeout_s)
                logger.info("pdserve connector: loaded %d blocks (%d failed), saved %d",
                            self.worker.num_loaded_blocks, self.worker.num_failed_blocks,
                            self.worker.num_saved_blocks)
                self.worker.close()
                self.worker = None
            if self.scheduler is not None:
                self.scheduler.close()
                self.scheduler = None

    classes: dict[str, type] = {"PdserveConnector": PdserveConnector,
                                "PdserveConnectorMetadata": PdserveConnectorMetadata}
    for name, cls in classes.items():  # so pickle finds them here (module __getattr__)
        cls.__module__, cls.__qualname__ = __name__, name
    return classes
