"""The KV block pool: free list, reference counts and prefix reuse by chained block keys.

Every block is in exactly one of three states:

    free    ref 0, no key      never computed, or its content is not shareable
    used    ref > 0            in some request's block table (shared prefix blocks: ref > 1)
    cached  ref 0, has a key   content still valid; reusable by key, evictable by LRU

Allocation takes free blocks first and only when the free list runs dry evicts the least
recently freed cached block (dropping its key). Free blocks are taken in runs of neighbours
(FreeBlocks): a table whose blocks follow each other in the pool is one stream in memory, which
a CPU's prefetchers read faster than scattered blocks. A block gets its key only after its KV has
been computed (`commit_computed`, called once a step has run), so a prefix hit never points
at KV that a concurrent chunk in the same step is still writing.

A request of n > 1 sequences forks once its prompt is prefilled (`fork`): each child's
table starts with the parent's full prompt blocks, shared (one more reference each, so a
shared block is freed only when its last holder goes), and a fresh block for the partial last
one, whose KV the engine copies in (copy-on-write, done at fork time):

    parent   [ b0 b1 b2 | b3 (partial) ]
    child i  [ b0 b1 b2 | c_i ]            b0..b2: ref count + 1;  c_i <- copy of b3

Keys come from pdserve.kvstore.block_key: the root folds in the model id, the KV layout and
the request's cache_salt, so the same keys name the same KV in the store and at the router.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdserve.kvstore.block_key import KVLayout, block_keys, root_key
from pdserve.serve.engine.request import Request


class BlockManagerIntegrityError(RuntimeError):
    """The pool's bookkeeping is inconsistent (a bug, never a user error)."""


class NoFreeBlocksError(RuntimeError):
    """allocate/append_slots was called although can_allocate/can_append said no."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_key: bytes | None = None
    epoch: int = 0
    """How often the block lost its key (evicted, or its content replaced): a reader off the
    engine thread (pdserve/serve/engine/kv_tiers.py) knows its copy is whole when this did not
    move."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FreeBlocks:
    """The free blocks as a map of the pool, taken in runs of neighbours.

    A request's table reads best when its blocks follow each other in the pool: the decode
    attention on CPU then streams each sequence's KV as one range, which the hardware
    prefetcher follows, instead of jumping between scattered blocks. So a new table takes a run
    of free blocks (next fit from where the last run ended, with room behind it to grow where
    the pool has some), and a growing table takes the block right after its last one while
    that is free.
    """

    def __init__(self, num_blocks: int) -> None:
        self._map = bytearray(b"\x01") * num_blocks  # 1: free
        self._count = num_blocks
        self._cursor = 0  # where the next search starts: the end of the last run taken

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block_id: int) -> bool:
        return 0 <= block_id < len(self._map) and self._map[block_id] == 1

    def __iter__(self) -> Iterator[int]:
        return (i for i, free in enumerate(self._map) if free)

    def add(self, block_id: int) -> None:
        if self._map[block_id]:
            raise BlockManagerIntegrityError(f"block {block_id} freed twice")
        self._map[block_id] = 1
        self._count += 1

    def remove(self, block_id: int) -> None:
        if block_id not in self:
            raise ValueError(f"block {block_id} is not free")
        self._map[block_id] = 0
        self._count -= 1

    def take_after(self, block_id: int) -> int | None:
        """The block right after `block_id`, if it is free."""
        following = block_id + 1
        if following not in self:
            return None
        self.remove(following)
        return following

    def take_run(self, num_blocks: int, room: int = 0) -> list[int]:
        """The first num_blocks of a free stretch of num_blocks + room (room: free blocks
        left behind them for the table to grow into), next fit; [] when none is that long."""
        stretch = b"\x01" * (num_blocks + room)
        start = self._map.find(stretch, self._cursor)
        if start < 0:
            start = self._map.find(stretch)
        if start < 0:
            return []
        self._map[start:start + num_blocks] = bytes(num_blocks)
        self._count -= num_blocks
        self._cursor = start + num_blocks + room
        return list(range(start, start + num_blocks))

    def take_any(self) -> int | None:
        """A free block (next fit), or None when there is none."""
        block_id = self._map.find(1, self._cursor)
        if block_id < 0:
            block_id = self._map.find(1)
        if block_id < 0:
            return None
        self.remove(block_id)
        self._cursor = block_id + 1
        return block_id


class BlockManager:
    """Owns the device KV pool's bookkeeping: the free list, each block's reference count
    and block key, the prefix cache (key -> block) and each request's block table; it never
    touches the KV tensors. `check_integrity()` proves free + used + cached == total. Called
    by the scheduler (allocate, append, free), the engine and the worker's hand-off code
    (reserve blocks for an incoming request)."""

    def __init__(self, num_blocks: int, block_size: int, model_id: str, kv_layout: KVLayout,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got "
                             f"{num_blocks}, {block_size}")
        if kv_layout.block_size != block_size:
            raise ValueError(f"kv_layout.block_size {kv_layout.block_size} != {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_id = model_id
        self.kv_layout = kv_layout
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free = FreeBlocks(num_blocks)
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._key_to_block: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_committed: dict[str, int] = {}  # leading blocks of a table that have keys
        self._reserved: dict[str, list[int]] = {}  # blocks held for a request not yet in
        self._reserved_hits: dict[str, int] = {}  # of those, leading prefix hits
        self._roots: dict[str | None, bytes] = {}
        self.max_num_used_blocks = 0
        """High-water mark of num_used_blocks (a shared block counts once)."""
        self.on_cached: Callable[[int, bytes], None] | None = None
        """Called with (block id, key) when a full block becomes cached (its last holder
        left): the host tier's write-down (pdserve/serve/engine/kv_tiers.py)."""

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def block_epoch(self, block_id: int) -> int:
        return self._blocks[block_id].epoch

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    # ---- keys ---------------------------------------------------------------------------
    def root(self, cache_salt: str | None) -> bytes:
        if cache_salt not in self._roots:
            self._roots[cache_salt] = root_key(self.model_id, self.kv_layout, cache_salt)
        return self._roots[cache_salt]

    def update_block_keys(self, request: Request) -> list[bytes]:
        """Extend request.block_keys to every full block of its known tokens."""
        keys = request.block_keys
        if len(keys) < request.num_tokens // self.block_size:
            keys.extend(block_keys(request.all_token_ids, self.block_size,
                                   self.root(request.cache_salt),
                                   start_key=keys[-1] if keys else None,
                                   start_block=len(keys)))
        return keys

    def request_blocks(self, request: Request) -> tuple[list[int], list[bytes]]:
        """(block ids of the request's table, keys of its computed full blocks): what a KV
        connector saves and what a decode worker looks up."""
        table = list(self.block_table(request.request_id))
        keys = self.update_block_keys(request)
        return table, list(keys[: request.num_computed_tokens // self.block_size])

    # ---- prefix lookup ------------------------------------------------------------------
    def _prefix_hits(self, request: Request, reuse_prefix: bool = True) -> list[int]:
        if not (self.enable_prefix_caching and reuse_prefix):
            return []
        # Keep at least one token to compute so the step produces logits to sample from.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        return self._blocks_of(self.update_block_keys(request)[:max_hit_blocks])

    def _blocks_of(self, keys: list[bytes]) -> list[int]:
        """The pool's blocks of the leading `keys` it holds."""
        hits: list[int] = []
        for key in keys:
            block_id = self._key_to_block.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _num_available_with(self, hits: list[int]) -> int:
        """Blocks left to take once `hits` are held: a hit on a cached block takes that
        block out of the evictable pool."""
        return self.num_free_blocks - sum(1 for b in hits if b in self._cached)

    def _hold(self, hits: list[int]) -> None:
        """One more reference to each of `hits` (a cached one is no longer evictable)."""
        for block_id in hits:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._cached[block_id]
            block.ref_count += 1

    def num_cached_tokens(self, request: Request) -> int:
        """Leading tokens of `request` whose KV is already in the pool (no side effects)."""
        return len(self._prefix_hits(request)) * self.block_size

    # ---- allocation ---------------------------------------------------------------------
    def can_allocate(self, request: Request, num_tokens: int, reuse_prefix: bool = True) -> bool:
        """Can a request without blocks get a table covering positions [0, num_tokens)?"""
        hits = self._prefix_hits(request, reuse_prefix)
        return self.num_blocks_for(num_tokens) - len(hits) <= self._num_available_with(hits)

    def allocate(self, request: Request, num_tokens: int, reuse_prefix: bool = True) -> int:
        """Give a request without blocks a table covering [0, num_tokens), reusing its cached
        prefix; returns the number of prefix tokens whose KV was found (block-aligned)."""
        if request.request_id in self._tables:
            raise ValueError(f"request {request.request_id!r} already has blocks")
        if not self.can_allocate(request, num_tokens, reuse_prefix):
            raise NoFreeBlocksError(f"cannot allocate {num_tokens} tokens for "
                                    f"{request.request_id!r}")
        hits = self._prefix_hits(request, reuse_prefix)
        self._hold(hits)
        # Room to grow: the blocks its prompt and max_tokens may still need past these
        num_new = self.num_blocks_for(num_tokens) - len(hits)
        room = self.num_blocks_for(request.num_prompt_tokens + request.max_tokens) \
            - self.num_blocks_for(num_tokens)
        table = hits + self._take_blocks(num_new, hits[-1] if hits else None, max(0, room))
        self._tables[request.request_id] = table
        self._num_committed[request.request_id] = len(hits)
        self._note_used()
        return len(hits) * self.block_size

    def can_append(self, request: Request, num_new_tokens: int) -> bool:
        """Can the request's table grow to cover num_computed_tokens + num_new_tokens?"""
        return self._num_missing(request, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, request: Request, num_new_tokens: int) -> list[int]:
        """Grow the table to cover num_computed_tokens + num_new_tokens; returns new blocks."""
        num_missing = self._num_missing(request, num_new_tokens)
        if num_missing == 0:  # most decode steps: the last block has room
            return []
        if num_missing > self.num_free_blocks:
            raise NoFreeBlocksError(f"cannot append {num_new_tokens} tokens for "
                                    f"{request.request_id!r}")
        table = self._tables[request.request_id]
        new_blocks = self._take_blocks(num_missing, table[-1] if table else None)
        table.extend(new_blocks)
        self._note_used()
        return new_blocks

    def _num_missing(self, request: Request, num_new_tokens: int) -> int:
        table = self._tables[request.request_id]
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(table))

    def free_tail(self, request: Request, num_tokens: int) -> int:
        """Release the request's blocks past those covering positions [0, num_tokens)
        (speculative decoding: the slots of rejected drafts); returns how many went. Such
        blocks were never committed, so they go back to the free list."""
        table = self._tables[request.request_id]
        keep = max(self.num_blocks_for(num_tokens), self._num_committed[request.request_id])
        tail = table[keep:]
        del table[keep:]
        self._release(tail)
        return len(tail)

    def reserve(self, request_id: str, num_blocks: int, prefix_keys: list[bytes] = ()
                ) -> list[int]:
        """Take `num_blocks` blocks for a request that is not here yet (decode role: its KV is
        copied in while its prefill runs elsewhere); claim() gives them to it, and
        unreserve() back. The first ones are this pool's blocks of the leading `prefix_keys`
        it holds (shared, their KV already there: num_reserved_hits says how many; prefix
        caching only), the rest fresh."""
        if request_id in self._reserved or request_id in self._tables:
            raise ValueError(f"request {request_id!r} already has blocks")
        hits = (self._blocks_of(list(prefix_keys)[:num_blocks]) if self.enable_prefix_caching
                else [])
        if num_blocks - len(hits) > self._num_available_with(hits):
            raise NoFreeBlocksError(f"cannot reserve {num_blocks} blocks for {request_id!r}")
        self._hold(hits)
        self._reserved[request_id] = hits + self._take_blocks(
            num_blocks - len(hits), hits[-1] if hits else None)
        self._reserved_hits[request_id] = len(hits)
        self._note_used()
        return list(self._reserved[request_id])

    def num_reserved_hits(self, request_id: str) -> int:
        """Of a reservation, the leading blocks that were prefix hits (KV already there)."""
        return self._reserved_hits.get(request_id, 0)

    def unreserve(self, request_id: str) -> None:
        """Free a reservation (idempotent)."""
        self._reserved_hits.pop(request_id, None)
        self._release(self._reserved.pop(request_id, []))

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(ids) for ids in self._reserved.values())

    def claim(self, request: Request, block_ids: list[int]) -> None:
        """Give a request exactly these blocks (decode role: the KV was loaded into them).
        Each must be free or cached (a cached one loses its key: its content is replaced),
        or be the request's own reservation, all of it."""
        if request.request_id in self._tables:
            raise ValueError(f"request {request.request_id!r} already has blocks")
        reserved = self._reserved.get(request.request_id)
        if reserved is not None:
            if list(block_ids) != reserved:
                raise ValueError(f"request {request.request_id!r} must claim its reservation "
                                 "as it is")
            del self._reserved[request.request_id]
            self._tables[request.request_id] = list(block_ids)
            self._num_committed[request.request_id] = self._reserved_hits.pop(
                request.request_id, 0)
            return
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("block_ids has duplicates")
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks or self._blocks[block_id].ref_count > 0:
                raise ValueError(f"block {block_id} is not free")
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block_id in self._cached:
                del self._cached[block_id]
                self._drop_key(block)
            else:
                self._free.remove(block_id)
            block.ref_count = 1
        self._tables[request.request_id] = list(block_ids)
        self._num_committed[request.request_id] = 0
        self._note_used()

    def can_fork(self, parent: Request) -> bool:
        """Can a child of `parent` get its own copy of the parent's partial last block?"""
        return self._num_fork_blocks(parent) <= self.num_free_blocks

    def _num_fork_blocks(self, parent: Request) -> int:
        """1 if the parent's table ends in a partially filled block, else 0."""
        return int(parent.num_computed_tokens % self.block_size != 0)

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give `child` the parent's table: its full blocks shared, a fresh block in place of
        a partially filled last one. Returns (the parent's partial block, the child's new
        one), whose KV the caller copies before the next step; None when all are full."""
        if child.request_id in self._tables:
            raise ValueError(f"request {child.request_id!r} already has blocks")
        if not self.can_fork(parent):
            raise NoFreeBlocksError(f"no block to fork {parent.request_id!r}")
        table = self._tables[parent.request_id]
        num_full = parent.num_computed_tokens // self.block_size
        shared = table[:num_full]
        for block_id in shared:
            self._blocks[block_id].ref_count += 1
        copy = None
        if self._num_fork_blocks(parent):
            copy = (table[num_full], self._take_block())
        self._tables[child.request_id] = shared + ([copy[1]] if copy else [])
        self._num_committed[child.request_id] = min(self._num_committed[parent.request_id],
                                                     num_full)
        self._note_used()
        return copy

    def _note_used(self) -> None:
        self.max_num_used_blocks = max(self.max_num_used_blocks, self.num_used_blocks)

    def _take_blocks(self, num_blocks: int, after: int | None, room: int = 0) -> list[int]:
        """num_blocks blocks for a table whose last block is `after` (None: a new table):
        the blocks following it while they are free, then a run (with `room` behind it where
        the pool has a stretch that long), then one at a time, then evicted cached ones. The
        caller has checked that there are enough free and cached blocks."""
        taken: list[int] = []
        while after is not None and len(taken) < num_blocks:
            following = self._free.take_after(after)
            if following is None:
                break
            self._blocks[following].ref_count = 1
            taken.append(after := following)
        rest = num_blocks - len(taken)
        if rest:
            run = (room > 0 and self._free.take_run(rest, room)) or self._free.take_run(rest)
            for block_id in run:
                self._blocks[block_id].ref_count = 1
            taken += run
        while len(taken) < num_blocks and len(self._free):
            taken.append(self._take_block(taken[-1] if taken else after))
        # The rest evicts the least recently freed cached blocks, in the pool's order: a
        # table freed tail first comes back as a run again, not reversed.
        return taken + sorted(self._take_block() for _ in range(num_blocks - len(taken)))

    def _take_block(self, after: int | None = None) -> int:
        """A block: the one after `after` if free, else any free one, else the least
        recently freed cached one."""
        block_id = self._free.take_after(after) if after is not None else None
        if block_id is None:
            block_id = self._free.take_any()
        if block_id is None:  # the free list ran dry: evict the least recently freed cached block
            block_id, _ = self._cached.popitem(last=False)
            self._drop_key(self._blocks[block_id])
        self._blocks[block_id].ref_count = 1
        return block_id

    def _drop_key(self, block: Block) -> None:
        assert block.block_key is not None
        del self._key_to_block[block.block_key]
        block.block_key = None
        block.epoch += 1

    # ---- after a step -------------------------------------------------------------------
    def commit_computed(self, request: Request, num_tokens: int | None = None) -> None:
        """Publish keys of the request's full blocks whose KV is now computed: its first
        `num_tokens` tokens' (default: num_computed_tokens), whose ids are on the host."""
        if not self.enable_prefix_caching or request.request_id not in self._tables:
            return
        table = self._tables[request.request_id]
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        num_tokens = min(num_tokens, request.num_computed_tokens, request.num_tokens)
        num_full = min(num_tokens // self.block_size, len(table))
        start = self._num_committed[request.request_id]
        if num_full <= start:
            return
        keys = self.update_block_keys(request)
        for i in range(start, num_full):
            block = self._blocks[table[i]]
            # A block reached by a prefix hit has its key already; a duplicate computed by a
            # concurrent request stays keyless (the first one is the shared copy).
            if block.block_key is None and keys[i] not in self._key_to_block:
                block.block_key = keys[i]
                self._key_to_block[keys[i]] = block.block_id
        self._num_committed[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks (finish, abort, preemption). Idempotent."""
        table = self._tables.pop(request.request_id, None)
        self._num_committed.pop(request.request_id, None)
        if table is None:
            return
        self._release(table)

    def _release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; an unreferenced one becomes evictable if it has
        a key (cached), else free. Tail first: a prompt's last blocks are the least likely to
        be shared, so they should be the first evicted."""
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_key is not None:
                    self._cached[block_id] = None
                    if self.on_cached is not None:
                        self.on_cached(block_id, block.block_key)
                else:
                    self._free.add(block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (used blocks keep their keys)."""
        while self._cached:
            block_id, _ = self._cached.popitem(last=False)
            self._drop_key(self._blocks[block_id])
            self._free.add(block_id)

    # ---- invariants ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise BlockManagerIntegrityError unless free + used + cached == total, every
        ref count equals the block's occurrences in tables, and the key map is a bijection
        onto keyed blocks."""
        def fail(message: str) -> None:
            raise BlockManagerIntegrityError(message)

        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free):
            fail(f"the free map holds {len(free)} blocks but counts {len(self._free)}")
        if free & cached:
            fail(f"blocks both free and cached: {sorted(free & cached)}")
        refs = [0] * self.num_blocks
        for request_id, table in [*self._tables.items(), *self._reserved.items()]:
            for block_id in table:
                if not 0 <= block_id < self.num_blocks:
                    fail(f"request {request_id!r} holds unknown block {block_id}")
                refs[block_id] += 1
        used = {i for i, r in enumerate(refs) if r > 0}
        if used & (free | cached):
            fail(f"blocks used and free/cached at once: {sorted(used & (free | cached))}")
        if len(free) + len(used) + len(cached) != self.num_blocks:
            fail(f"free {len(free)} + used {len(used)} + cached {len(cached)} != "
                 f"total {self.num_blocks}")
        for block in self._blocks:
            if block.ref_count != refs[block.block_id]:
                fail(f"block {block.block_id}: ref_count {block.ref_count} but "
                     f"{refs[block.block_id]} table entries")
            if block.block_id in free and block.block_key is not None:
                fail(f"free block {block.block_id} has a key")
            if block.block_id in cached and block.block_key is None:
                fail(f"cached block {block.block_id} has no key")
            if block.block_key is not None and \
                    self._key_to_block.get(block.block_key) != block.block_id:
                fail(f"block {block.block_id}'s key does not map back to it")
        for key, block_id in self._key_to_block.items():
            if self._blocks[block_id].block_key != key:
                fail(f"key map entry for block {block_id} does not match its key")
        for request_id, num_committed in self._num_committed.items():
            if num_committed > len(self._tables.get(request_id, ())):
                fail(f"request {request_id!r} committed more blocks than it holds")
