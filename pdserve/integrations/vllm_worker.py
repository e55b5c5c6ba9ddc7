"""The worker half of pdserve's vLLM connector, on plain tensors (no vLLM import).

vLLM's per-layer paged KV tensors are viewed, without a copy, as pdserve's pool layout
[2, num_blocks, B, H, D] (POOL_VIEWS, by vLLM attention backend; K and V planes may have
different strides, PlanesAsPool joins them), so pdserve's StoreConnector
(pdserve/kvstore/connector.py) moves the blocks: its thread fetches a step's loads and copies them
in layer by layer while the forward waits on each layer (wait_for_layer); a save copies each
layer's blocks out as the layer finishes (the pool blocks are free again at once) and the put
runs on that thread, off the critical path. After the forward, finish_step settles the step:
the blocks past each load's placed prefix are reported as invalid (vLLM recomputes them), and
each load's lease goes back to the store.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pdserve.integrations.vllm_scheduler import BlockTransfer, StepPlan
from pdserve.kvstore.block_key import KVLayout
from pdserve.kvstore.client import StoreClient
from pdserve.kvstore.connector import StoreConnector

logger = logging.getLogger(__name__)

RESULT_WAIT_S = 5.0  # a load's result later than this after its last layer is logged


# ---- worker side: vLLM's paged KV as pdserve's pool layout --------------------------------------


def cpu_attn_planes(cache: torch.Tensor, layout: KVLayout, num_kv_heads: int
                    ) -> list[torch.Tensor]:
    """vLLM's CPU_ATTN cache of one layer (ISA "vec" or "vec16") as its K and V planes, each
    [num_blocks, B, H, D], without a copy. vLLM allocates [num_blocks, H, B, 2*D]; its kernels
    view each (block, head) as 2*B*D elements and write K there transposed, V as rows:

        (block, head):  K^T [D, B] (dim-major: token t of dim d at d*B + t) | V [B, D]
    """
    num_blocks, heads, block_size, width = cache.shape
    if (heads, block_size, width) != (num_kv_heads, layout.block_size, 2 * layout.head_dim):
        raise ValueError(f"CPU_ATTN cache of shape {tuple(cache.shape)} is not "
                         f"[num_blocks, {num_kv_heads}, {layout.block_size}, "
                         f"{2 * layout.head_dim}]")
    halves = cache.view(num_blocks, heads, 2, block_size * layout.head_dim)
    keys = halves[:, :, 0].unflatten(2, (layout.head_dim, block_size)).permute(0, 3, 1, 2)
    values = halves[:, :, 1].unflatten(2, (block_size, layout.head_dim)).permute(0, 2, 1, 3)
    return [keys, values]


PoolView = Callable[[torch.Tensor, KVLayout, int], list[torch.Tensor]]
# (vLLM attention backend, its CPU ISA) -> the planes of one layer's cache. Only layouts
# checked against vLLM's own kernels are here: another backend or ISA (CPU_ATTN's "amx" or
# "neon", GPU backends) is refused at start rather than misread.
POOL_VIEWS: dict[tuple[str, str | None], PoolView] = {
    ("CPU_ATTN", "vec"): cpu_attn_planes, ("CPU_ATTN", "vec16"): cpu_attn_planes}


class PlanesAsPool:
    """One layer's planes, each [num_blocks, B, H, D] with strides of its own, as the single
    [P, num_blocks, B, H, D] pool tensor pdserve's StoreConnector copies blocks into and out of
    (it asks for index_copy_, index_select and slices `[:, a:b]` along the block dim, view,
    device, dtype, is_cuda)."""

    def __init__(self, planes: Sequence[torch.Tensor]) -> None:
        if len({(p.shape, p.dtype, p.device) for p in planes}) != 1:
            raise ValueError("the planes of one layer must agree in shape, dtype and device")
        self.planes = list(planes)

    @property
    def device(self) -> torch.device:
        return self.planes[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.planes[0].dtype

    @property
    def is_cuda(self) -> bool:
        return self.planes[0].is_cuda

    def element_size(self) -> int:
        return self.planes[0].element_size()

    def view(self, dtype: torch.dtype) -> PlanesAsPool:
        """The same planes seen as `dtype` (FP8 caches are copied as bytes)."""
        return PlanesAsPool([plane.view(dtype) for plane in self.planes])

    def index_copy_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> PlanesAsPool:
        """source [P, n, B, H, D] into blocks `index` of every plane."""
        if dim != 1 or source.shape[0] != len(self.planes):
            raise ValueError("PlanesAsPool copies [P, n, ...] along the block dim (1)")
        for plane, blocks in zip(self.planes, source, strict=True):
            plane.index_copy_(0, index, blocks)
        return self

    def __getitem__(self, index: tuple[slice, slice]) -> torch.Tensor:
        """pool[:, a:b]: blocks a..b-1 of every plane, [P, b - a, B, H, D] (a copy)."""
        if not (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)
                and isinstance(index[1], slice)):
            raise TypeError("PlanesAsPool takes pool[:, a:b] only")
        return torch.stack([plane[index[1]] for plane in self.planes])

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Blocks `index` of every plane: [P, n, B, H, D] (a copy)."""
        if dim != 1:
            raise ValueError("PlanesAsPool selects along the block dim (1)")
        return torch.stack([plane.index_select(0, index) for plane in self.planes])


_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(layer_name: str) -> int:
    """The model layer of an attention layer name ("model.layers.3.self_attn.attn" -> 3)."""
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise ValueError(f"no layer number in attention layer name {layer_name!r}")
    return int(match.group(1))


class PdserveWorker:
    """The worker half, on plain tensors: runs a StepPlan's loads and saves through pdserve's
    StoreConnector, and reports the blocks that did not load."""

    def __init__(self, layout: KVLayout, client: StoreClient, tp_rank: int = 0,
                 tp_size: int = 1, timeout_s: float = 5.0):
        self.layout = layout
        self.timeout_s = timeout_s
        self._layer_wait_s = 2 * timeout_s + 10.0  # a fetch gives up after timeout_s itself
        self._client = client
        self._kv = StoreConnector(client, layout, tp_rank=tp_rank, tp_size=tp_size,
                               timeout_s=timeout_s)
        self._num_heads = len(range(layout.num_kv_heads)[layout.rank_heads(tp_rank, tp_size)])
        self._views: list[PlanesAsPool] = []
        self._layer_of: dict[str, int] = {}
        self._loads: dict[str, BlockTransfer] = {}  # this step's
        self._num_placed: dict[str, int] = {}
        self._layers_saved: dict[str, set[int]] = {}
        self._invalid_block_ids: set[int] = set()
        self.num_loaded_blocks = 0
        self.num_failed_blocks = 0
        self.num_saved_blocks = 0

    def register(self, caches: Mapping[str, torch.Tensor], view: PoolView) -> None:
        """Take vLLM's per-layer caches (layer name -> tensor), one per model layer."""
        order = sorted(caches, key=layer_index)
        if [layer_index(name) for name in order] != list(range(self.layout.num_layers)):
            raise ValueError(f"expected one KV cache per layer 0..{self.layout.num_layers - 1}"
                             f", got {order}")
        self._views = [PlanesAsPool(view(caches[name], self.layout, self._num_heads))
                       for name in order]
        self._layer_of = {name: i for i, name in enumerate(order)}

    # ---- loads ---------------------------------------------------------------------------
    def start_loads(self, plan: StepPlan) -> None:
        for load in plan.loads:
            if not load.keys or load.request_id in self._loads:
                continue
            try:
                self._kv.start_load(load.request_id, load.keys, load.block_ids, self._views)
            except Exception as e:  # nothing was placed: vLLM recomputes every block
                logger.warning("pdserve connector: load of %s not started (%s)",
                               load.request_id, e)
                self._invalid_block_ids.update(load.block_ids)
                self.num_failed_blocks += len(load.keys)
                continue
            self._loads[load.request_id] = load
            self._num_placed[load.request_id] = len(load.keys)

    def wait_for_layer(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for request_id in self._loads:
            self._wait(request_id, layer)

    def _wait(self, request_id: str, layer: int) -> None:
        placed = self._kv.wait_for_layer_load(request_id, layer, self._layer_wait_s)
        self._num_placed[request_id] = min(self._num_placed[request_id], placed)

    def _finish_loads(self) -> None:
        """Wait for every layer of this step's loads and their results; the blocks past each
        load's placed prefix are invalid (vLLM recomputes them).

        A load is waited out even past its layers' bounded waits: a copy landing after vLLM
        recomputed those blocks would overwrite good KV. It ends: its store requests time out
        on their own."""
        if not self._loads:
            return
        for request_id in self._loads:
            for layer in range(self.layout.num_layers):
                self._wait(request_id, layer)
        pending = set(self._loads)
        started_s, warned = time.monotonic(), False
        while pending:
            for result in self._kv.poll():
                self._count(result)
                if result.kind == "load" and result.request_id in pending:
                    pending.discard(result.request_id)
                    placed = self._num_placed[result.request_id]
                    self._num_placed[result.request_id] = min(placed, result.num_blocks)
            if pending:
                if not warned and time.monotonic() - started_s > RESULT_WAIT_S:
                    logger.warning("pdserve connector: still waiting for loads of %s",
                                   sorted(pending))
                    warned = True
                time.sleep(0.001)
        for request_id, load in self._loads.items():
            placed = self._num_placed[request_id]
            self.num_loaded_blocks += placed
            if placed < len(load.keys):
                self.num_failed_blocks += len(load.keys) - placed
                self._invalid_block_ids.update(load.block_ids[placed:])
                logger.warning("pdserve connector: %d of %d blocks of %s did not load; vLLM "
                               "recomputes them", len(load.keys) - placed, len(load.keys),
                               request_id)
            if load.lease_id is not None:
                self._kv.release(load.lease_id)
        self._loads.clear()
        self._num_placed.clear()

    def take_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    # ---- saves ---------------------------------------------------------------------------
    def save_layer(self, layer_name: str, plan: StepPlan) -> None:
        """Copy this layer's blocks of the step's saves out (the put follows the last
        layer). A failure drops the save: the blocks are only not cached."""
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for save in plan.saves:
            done = self._layers_saved.setdefault(save.request_id, set())
            if layer in done or not save.keys:
                continue
            try:
                self._kv.save_layer(save.request_id, layer, save.keys, save.block_ids,
                                    self._views[layer])
            except Exception as e:
                logger.warning("pdserve connector: saving %s failed (%s)", save.request_id, e)
                self._kv.abort(save.request_id)
                done.update(range(self.layout.num_layers))  # no more layers of it
                continue
            done.add(layer)

    def _finish_saves(self) -> None:
        for request_id, done in self._layers_saved.items():
            if len(done) < self.layout.num_layers:  # a layer never came: drop the staging
                logger.warning("pdserve connector: save of %s saw %d of %d layers; dropped",
                               request_id, len(done), self.layout.num_layers)
                self._kv.abort(request_id)
        self._layers_saved.clear()

    def finish_step(self) -> None:
        """After the step's forward: settle its loads and saves."""
        self._finish_loads()
        self._finish_saves()
        for result in self._kv.poll():
            self._count(result)

    def _count(self, result: Any) -> None:
        if result.kind == "save":
            self.num_saved_blocks += result.num_blocks
            if result.error is not None:
                logger.warning("pdserve connector: put of %s: %s", result.request_id,
                               result.error)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for queued puts and releases (tests; shutdown)."""
        done = self._kv.drain(timeout_s)
        for result in self._kv.poll():
            self._count(result)
        return done

    def close(self) -> None:
        self._kv.close()
        self._client.close()
