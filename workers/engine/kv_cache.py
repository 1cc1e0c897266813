"""Paged KV cache accounting: fixed-size blocks, ref-counted sharing, a salted prefix cache.

The simulated engine holds no tensors, but it must run out of memory exactly where a real
engine would, so this is the bookkeeping of vLLM's block manager:

- Memory is ``num_blocks`` blocks of ``block_size`` token slots. A sequence holds a list of
  blocks (its block table) that grows one block at a time as its context grows.
- A block that is full and whose contents are computed gets a content key. Requests whose
  prompts start with the same full blocks, under the same cache salt, reuse those blocks
  instead of computing them (``cached_prompt_tokens``). The key of a block is
  ``(content id of the previous block, its token ids)`` and the first block's parent is the
  salt, so a block is shared only when the whole prefix up to it and the salt are equal (a hash
  chain as in vLLM, but with ids handed out here instead of digests: keys are compared exactly,
  so no hash collision can leak a block between tenants, I1, and hashing stays O(block size)).
- A block may be in several block tables at once; ``refcount`` counts them. When it drops to
  zero the block is free: a cached block goes to an LRU list where it can still be hit until it
  is evicted to make room; an uncached one goes straight to the free list.

Invariants (``check()`` asserts them; tests call it after every operation):
- every block is in exactly one of: in use (refcount > 0), free list, evictable LRU;
- ``used_blocks + free_blocks == num_blocks``; no refcount is negative;
- the prefix index maps each key to a block that carries that key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BlockKey = tuple[Any, tuple[int, ...]]


@dataclass(frozen=True)
class ModelGeometry:
    """What one token of context costs in KV memory: the design's capacity estimate."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, in every layer, for every KV head.
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_tokens(self, memory_bytes: int) -> int:
        """Tokens of context that fit in a KV memory budget (design: 50 GB -> ~381,000)."""
        return memory_bytes // self.kv_bytes_per_token


class BlockTable:
    """One sequence's blocks, in order, and how far its full blocks are registered."""

    __slots__ = ("blocks", "hashed", "parent")

    def __init__(self, salt: str) -> None:
        self.blocks: list[int] = []
        self.hashed = 0  # leading blocks that carry a content key
        self.parent: Any = ("salt", salt)  # content id of the last keyed block, or the root


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.refcount = [0] * num_blocks
        self.key: list[BlockKey | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack, block 0 on top
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._index: dict[BlockKey, int] = {}
        self.content_id = [0] * num_blocks  # id of the content a keyed block holds
        self._next_id = 1
        self.evictions = 0

    # -- capacity -------------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._index)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------

    def _match(self, salt: str, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks for the longest run of full prompt blocks, leaving >= 1 token to compute.

        A real engine must run the last prompt token to get logits, so even a fully cached
        prompt recomputes its last token (vLLM does the same).
        """
        if not self.prefix_caching:
            return []
        bs = self.block_size
        parent: Any = ("salt", salt)
        hits: list[int] = []
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            key = (parent, tuple(token_ids[start : start + bs]))
            block = self._index.get(key)
            if block is None:
                break
            hits.append(block)
            parent = self.content_id[block]
        return hits

    # -- allocation -----------------------------------------------------------------------

    def allocate(
        self, table: BlockTable, salt: str, token_ids: Sequence[int], reserve: int = 0
    ) -> int | None:
        """Blocks for a whole prompt (admission). Returns cached tokens, or None if it won't fit.

        ``reserve`` blocks must stay free afterwards (a watermark, so an admitted sequence does
        not force a preemption on its first decode step).
        """
        hits = self._match(salt, token_ids)
        needed = self.blocks_for(len(token_ids)) - len(hits)
        # Hit blocks sitting in the LRU are free now and stop being free when taken.
        revived = sum(1 for b in hits if self.refcount[b] == 0)
        if self.free_blocks - revived - needed < reserve:
            return None
        for block in hits:
            self._take(block)
        table.blocks.extend(hits)
        table.hashed = len(hits)
        if hits:
            table.parent = self.content_id[hits[-1]]
        for _ in range(needed):
            table.blocks.append(self._pop_free())
        return len(hits) * self.block_size

    def append_slot(self, table: BlockTable, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` of context; False (and nothing changed) if out of blocks."""
        needed = self.blocks_for(num_tokens) - len(table.blocks)
        if needed <= 0:
            return True
        if needed > self.free_blocks:
            return False
        for _ in range(needed):
            table.blocks.append(self._pop_free())
        return True

    def commit(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Give content keys to the blocks that became full and computed, so others can hit them."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(table.blocks))
        while table.hashed < full:
            i = table.hashed
            key = (table.parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = table.blocks[i]
            owner = self._index.get(key)
            if owner is None and self.key[block] is None:
                self.key[block] = key
                self._index[key] = owner = block
                self.content_id[block] = self._next_id
                self._next_id += 1
            # Same content computed twice (two sequences raced): keep one copy in the index and
            # chain on its id, so later prompts still match the whole prefix.
            table.parent = self.content_id[owner] if owner is not None else 0
            table.hashed += 1

    def free(self, table: BlockTable) -> None:
        """Release a sequence's blocks (finish, abort, preemption). Idempotent per table."""
        # Tail blocks first into the LRU: they are the least likely to be shared, so evict first.
        for block in reversed(table.blocks):
            rc = self.refcount[block] - 1
            if rc < 0:
                raise AssertionError(f"block {block} freed more often than taken")
            self.refcount[block] = rc
            if rc == 0:
                if self.key[block] is not None:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        table.blocks.clear()
        table.hashed = 0

    def _take(self, block: int) -> None:
        if self.refcount[block] == 0:
            del self._evictable[block]
        self.refcount[block] += 1

    def _pop_free(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._index[self.key[block]]  # type: ignore[arg-type]
            self.key[block] = None
            self.evictions += 1
        self.refcount[block] = 1
        return block

    def reset_prefix_cache(self) -> None:
        """Forget every free cached block (e.g. after a salt rotation)."""
        for block in list(self._evictable):
            del self._index[self.key[block]]  # type: ignore[arg-type]
            self.key[block] = None
            self._free.append(block)
        self._evictable.clear()

    # -- invariants -----------------------------------------------------------------------

    def check(self, tables: Sequence[BlockTable] = ()) -> None:
        """Assert the invariants; with ``tables``, also that refcounts equal the references."""
        free = set(self._free)
        lru = set(self._evictable)
        assert len(free) == len(self._free), "block twice in the free list"
        assert not free & lru, "block both free and evictable"
        for b in range(self.num_blocks):
            rc = self.refcount[b]
            assert rc >= 0, f"negative refcount on block {b}"
            assert (rc == 0) == (b in free or b in lru), f"block {b} refcount {rc} vs free lists"
            assert b not in lru or self.key[b] is not None, f"uncached block {b} in LRU"
        assert self.used_blocks + self.free_blocks == self.num_blocks
        for key, b in self._index.items():
            assert self.key[b] == key, f"index points at block {b} with another key"
        if tables:
            refs = [0] * self.num_blocks
            for t in tables:
                for b in t.blocks:
                    refs[b] += 1
            assert refs == self.refcount, "refcounts differ from block-table references"
