"""The paged KV block manager: capacity from geometry, prefix sharing per salt, no leaks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from workers.engine.kv_cache import BlockManager, BlockTable, ModelGeometry

BS = 4


def test_design_capacity_estimate():
    geometry = ModelGeometry(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert geometry.kv_bytes_per_token == 128 * 1024
    assert geometry.kv_tokens(50 * 10**9) == pytest.approx(381_000, abs=1_000)
    # The design's "check yourself": 40 layers -> 160 KiB per token.
    assert ModelGeometry(layers=40).kv_bytes_per_token == 160 * 1024


def test_same_salt_shares_full_prompt_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    first = BlockTable("a")
    assert bm.allocate(first, "a", prompt) == 0
    bm.commit(first, prompt, num_computed=10)
    second = BlockTable("a")
    assert bm.allocate(second, "a", prompt) == 8
    assert second.blocks[:2] == first.blocks[:2]
    assert second.blocks[2] != first.blocks[2]
    assert bm.refcount[first.blocks[0]] == 2
    # An exactly block-aligned prompt still recomputes its last token (one block less cached).
    aligned = list(range(8))
    third = BlockTable("a")
    assert bm.allocate(third, "a", aligned) == 4
    bm.check([first, second, third])


def test_other_salt_never_hits():
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(12))
    mine = BlockTable("tenant-a")
    bm.allocate(mine, "tenant-a", prompt)
    bm.commit(mine, prompt, 12)
    theirs = BlockTable("tenant-b")
    assert bm.allocate(theirs, "tenant-b", prompt) == 0
    assert not set(mine.blocks) & set(theirs.blocks)


def test_prefix_must_match_from_the_start():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = BlockTable("s")
    bm.allocate(a, "s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.commit(a, [1, 2, 3, 4, 5, 6, 7, 8, 9], 9)
    b = BlockTable("s")
    # Second block equal, first block different: no hit (the chain includes the parent).
    assert bm.allocate(b, "s", [0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_freed_cached_blocks_hit_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(9))  # 3 blocks
    t = BlockTable("s")
    bm.allocate(t, "s", prompt)
    bm.commit(t, prompt, 9)
    bm.free(t)
    assert bm.free_blocks == 4 and bm.cached_blocks == 2
    again = BlockTable("s")
    assert bm.allocate(again, "s", prompt) == 8
    bm.free(again)
    # A different prompt needing every block evicts the cached ones.
    other = BlockTable("s")
    assert bm.allocate(other, "s", list(range(100, 116))) == 0
    assert bm.cached_blocks == 0 and bm.evictions == 2
    bm.check([other])


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    holder = BlockTable("s")
    bm.allocate(holder, "s", list(range(8)))
    t = BlockTable("s")
    assert bm.allocate(t, "s", list(range(20, 32))) is None
    assert t.blocks == [] and bm.used_blocks == 2
    assert bm.allocate(t, "s", list(range(20, 28)), reserve=1) is None
    assert bm.append_slot(holder, 17) is False and len(holder.blocks) == 2
    bm.check([holder])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random joins, growth, aborts and preemptions; the invariants hold after every one."""

    tables = Bundle("tables")

    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks):
        self.bm = BlockManager(num_blocks=num_blocks, block_size=BS)
        self.live: dict[int, tuple[BlockTable, list[int]]] = {}
        self.next_id = 0

    @rule(
        target=tables,
        salt=st.sampled_from(["a", "b"]),
        # A tiny alphabet and shared openings make prefix hits common.
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20),
        reserve=st.integers(0, 2),
    )
    def join(self, salt, prompt, reserve):
        table = BlockTable(salt)
        free_before = self.bm.free_blocks
        cached = self.bm.allocate(table, salt, prompt, reserve)
        if cached is None:
            assert table.blocks == [] and self.bm.free_blocks == free_before
            return -1
        assert 0 <= cached < len(prompt) and cached % BS == 0
        # Prefill completes: its full blocks become shareable.
        self.bm.commit(table, prompt, len(prompt))
        self.next_id += 1
        self.live[self.next_id] = (table, list(prompt))
        return self.next_id

    @rule(tid=tables, new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, tid, new):
        if tid not in self.live:
            return
        table, tokens = self.live[tid]
        if not self.bm.append_slot(table, len(tokens) + len(new)):
            # Out of blocks during decode: preempt (free everything this sequence holds).
            self.bm.free(table)
            del self.live[tid]
            return
        tokens.extend(new)
        self.bm.commit(table, tokens, len(tokens))

    @rule(tid=consumes(tables))
    def finish_or_abort(self, tid):
        if tid in self.live:
            table, _ = self.live.pop(tid)
            self.bm.free(table)

    @invariant()
    def accounting_holds(self):
        if hasattr(self, "bm"):
            self.bm.check([t for t, _ in self.live.values()])

    def teardown(self):
        if hasattr(self, "bm"):
            for table, _ in self.live.values():
                self.bm.free(table)
            self.bm.check()
            assert self.bm.used_blocks == 0
            assert self.bm.free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
