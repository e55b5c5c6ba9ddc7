"""Block keys: a chain of cryptographic hashes over token ids.

    root  = H("pdserve-kv-root", model identity, KV layout, cache_salt)
    key_0 = H(root,    tokens[0 : B])
    key_1 = H(key_0,   tokens[B : 2B])          B = block size in tokens
    ...

A key names a block *and everything before it*, so equal keys mean equal prefixes. The root
folds in the model and the KV layout (dtype, block size, layers, head layout), so blocks of
different models, layouts or tenants (cache_salt) never match. Only full blocks have keys: a
partial last block is never shared.

The engine's prefix cache, the store and the router all use this one module, so a key computed
at the router names the same bytes in every worker and store node.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

# blake2b-128 keys: collisions need ~2^64 blocks (the wire validates the same length)
from pdserve.protocol.worker import BLOCK_KEY_BYTES as KEY_BYTES


@dataclass(frozen=True)
class KVLayout:
    """What a KV block holds; two workers can share blocks only if their layouts are equal."""

    dtype: str  # "float32", "bfloat16", ...
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int  # total over all TP ranks: the layout is independent of TP degree
    head_dim: int  # row width: per KV head ("mha"), or kv_lora_rank + rope dims ("mla")
    kind: str = "mha"  # "mha" (K and V per head) or "mla" (one compressed latent row per token)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.kind not in ("mha", "mla"):
            raise ValueError(f"KVLayout.kind must be 'mha' or 'mla', got {self.kind!r}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"an MLA layout has one latent row per token (num_kv_heads 1), "
                             f"got {self.num_kv_heads}")

    @property
    def num_planes(self) -> int:
        """Tensors per layer and block: K and V ("mha"), or the latent row alone ("mla")."""
        return 2 if self.kind == "mha" else 1

    def rank_heads(self, tp_rank: int, tp_size: int) -> slice:
        """The KV heads TP rank r of t holds: an even split of the heads ("mha"; the heads
        must divide), or all of them ("mla": every rank keeps the whole latent cache)."""
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"bad TP rank {tp_rank} of {tp_size}")
        if self.kind == "mla":
            return slice(0, self.num_kv_heads)
        if self.num_kv_heads % tp_size:
            raise ValueError(f"{self.num_kv_heads} KV heads do not split over TP {tp_size}")
        per_rank = self.num_kv_heads // tp_size
        return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)

    def block_shape(self) -> tuple[int, int, int, int, int]:
        """One stored block: [num_layers, num_planes, block_size, num_kv_heads, head_dim]."""
        return (self.num_layers, self.num_planes, self.block_size, self.num_kv_heads,
                self.head_dim)


def _hash(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefix: no two splits hash alike
        h.update(part)
    return h.digest()


def root_key(
    model_id: str, layout: KVLayout | Mapping[str, object], cache_salt: str | None = None
) -> bytes:
    """The chain's root for one model, KV layout and (optional) tenant salt."""
    layout_dict = asdict(layout) if isinstance(layout, KVLayout) else dict(layout)
    layout_bytes = json.dumps(layout_dict, sort_keys=True).encode()
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    return _hash(b"pdserve-kv-root", model_id.encode(), layout_bytes, salt)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype=np.int64).astype("<i8", copy=False).tobytes()


def next_key(parent: bytes, block_token_ids: Sequence[int]) -> bytes:
    """key_i from key_{i-1} (or the root) and the tokens of block i."""
    return _hash(parent, _token_bytes(block_token_ids))


def block_keys(
    token_ids: Sequence[int], block_size: int, root: bytes, start_key: bytes | None = None,
    start_block: int = 0,
) -> list[bytes]:
    """Keys of every *full* block of `token_ids`.

    With `start_key`/`start_block`, resume a chain: keys for blocks start_block, start_block+1,
    ... where `start_key` is the key of block start_block-1 (incremental hashing during decode).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[bytes] = []
    parent = root if start_key is None else start_key
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        parent = next_key(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys
