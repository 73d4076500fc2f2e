"""The block allocator: paged-KV bookkeeping checked by hand on small caches."""

import pytest

from labkit.core.blocks import BlockAllocator, BlockEvent, NoFreeBlocksError, blocks_for


def test_allocate_rounds_tokens_up_to_whole_blocks():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    assert allocator.allocate("a", 5) == [0, 1]  # 5 tokens need ceil(5 / 4) = 2 blocks
    assert allocator.block_tables["a"] == [0, 1]
    assert allocator.ref_counts == [1, 1, 0, 0]
    assert allocator.num_free_blocks == 2
    # Growing to 8 tokens still fits in 2 blocks; growing to 9 takes exactly one more.
    assert allocator.allocate("a", 8) == []
    assert allocator.allocate("a", 9) == [2]
    assert allocator.block_tables["a"] == [0, 1, 2]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_blocks_for_is_the_fewest_blocks_that_hold_the_tokens(block_size):
    for num_tokens in range(4 * block_size + 2):
        blocks = blocks_for(num_tokens, block_size)
        assert (blocks - 1) * block_size < num_tokens <= blocks * block_size or num_tokens == blocks == 0


def test_blocks_needed_counts_only_missing_blocks():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    assert allocator.blocks_needed("a", 0) == 0
    assert allocator.blocks_needed("a", 1) == 1
    assert allocator.blocks_needed("a", 12) == 3
    allocator.allocate("a", 6)
    assert allocator.blocks_needed("a", 6) == 0
    assert allocator.blocks_needed("a", 9) == 1
    assert allocator.can_allocate("a", 4 * 8)
    assert not allocator.can_allocate("a", 4 * 8 + 1)


def test_allocating_past_capacity_raises_and_takes_nothing():
    allocator = BlockAllocator(num_blocks=3, block_size=2)
    allocator.allocate("a", 3)  # blocks 0, 1
    allocator.drain_events()
    with pytest.raises(NoFreeBlocksError, match="needs 2 blocks, only 1 free"):
        allocator.allocate("b", 4)
    assert allocator.num_free_blocks == 1
    assert "b" not in allocator.block_tables
    assert allocator.ref_counts == [1, 1, 0]
    assert allocator.events == []
    with pytest.raises(NoFreeBlocksError):
        allocator.allocate("a", 7)  # growing an existing table is all-or-nothing too
    assert allocator.block_tables["a"] == [0, 1]
    assert allocator.num_free_blocks == 1


def test_free_returns_blocks_and_double_free_raises():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.allocate("a", 3)  # blocks 0, 1
    allocator.allocate("b", 2)  # block 2
    assert allocator.free("a") == [0, 1]
    assert allocator.ref_counts == [0, 0, 1, 0]
    assert allocator.num_free_blocks == 3
    assert "a" not in allocator.block_tables
    with pytest.raises(KeyError, match="double free"):
        allocator.free("a")
    with pytest.raises(KeyError):
        allocator.free("never-allocated")
    assert allocator.num_free_blocks == 3
    # Freed blocks go to the back of the queue: the never-used block 3 is handed out first.
    assert allocator.allocate("c", 2) == [3]


def test_append_slot_claims_one_slot_at_a_time():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.allocate("a", 3)  # blocks 0, 1: slots 0, 1, 2 are token 0, 1, 2
    assert allocator.append_slot("a") == 3  # token 3: last slot of block 1
    assert allocator.block_tables["a"] == [0, 1]
    assert allocator.append_slot("a") == 4  # token 4: needs a new block, block 2, slot 2 * 2 + 0
    assert allocator.block_tables["a"] == [0, 1, 2]
    assert allocator.num_slots["a"] == 5
    with pytest.raises(KeyError, match="owns no blocks"):
        allocator.append_slot("nobody")


def test_append_slot_on_a_full_cache_raises():
    allocator = BlockAllocator(num_blocks=1, block_size=2)
    allocator.allocate("a", 2)
    with pytest.raises(NoFreeBlocksError):
        allocator.append_slot("a")
    assert allocator.num_slots["a"] == 2
    assert allocator.block_tables["a"] == [0]


def test_slot_formula_on_a_non_contiguous_table():
    allocator = BlockAllocator(num_blocks=6, block_size=4)
    allocator.allocate("a", 4)  # block 0
    allocator.allocate("b", 4)  # block 1
    allocator.allocate("a", 10)  # blocks 2, 3: a's table is [0, 2, 3]
    table = allocator.block_tables["a"]
    assert table == [0, 2, 3]
    # Token 5 is in the table's second block (5 // 4 = 1), offset 1: block 2, slot 2 * 4 + 1 = 9.
    assert allocator.slot("a", 5) == 9
    assert allocator.slot("a", 9) == 3 * 4 + 1
    expected = [table[i // 4] * 4 + i % 4 for i in range(10)]
    assert expected == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]
    assert allocator.slot_mapping("a", 0, 10) == expected
    assert allocator.slot_mapping("a", 3, 6) == [3, 8, 9]
    assert allocator.slot_mapping("b", 0, 4) == [4, 5, 6, 7]


def test_events_carry_step_and_request_id():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.step = 1
    allocator.allocate(7, 3)
    allocator.step = 2
    allocator.allocate(8, 1)
    allocator.free(7)
    assert allocator.drain_events() == [
        BlockEvent("alloc", 0, 7, 1),
        BlockEvent("alloc", 1, 7, 1),
        BlockEvent("alloc", 2, 8, 2),
        BlockEvent("free", 0, 7, 2),
        BlockEvent("free", 1, 7, 2),
    ]
    assert allocator.drain_events() == []  # draining empties the log


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "error", "match"),
    [
        (0, 4, ValueError, "num_blocks must be >= 1, got 0"),
        (-2, 4, ValueError, "num_blocks must be >= 1, got -2"),
        (4, 0, ValueError, "block_size must be >= 1, got 0"),
        (4, -1, ValueError, "block_size must be >= 1"),
        (4.0, 4, TypeError, "num_blocks must be an int, got float"),
        (4, True, TypeError, "block_size must be an int, got bool"),
    ],
)
def test_bad_sizes_are_rejected(num_blocks, block_size, error, match):
    with pytest.raises(error, match=match):
        BlockAllocator(num_blocks, block_size)


def test_a_table_started_empty_claims_its_first_slot_first():
    allocator = BlockAllocator(num_blocks=2, block_size=2)
    assert allocator.allocate("a", 0) == []
    assert allocator.block_tables["a"] == [] and allocator.num_slots["a"] == 0
    assert allocator.append_slot("a") == 0  # token 0: slot 0 of the first block taken
    assert allocator.num_slots["a"] == 1


def test_rollback_after_commit_changes_nothing():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.checkpoint()
    allocator.allocate("a", 3)
    allocator.commit()
    allocator.rollback()  # no checkpoint since the commit: a no-op
    assert allocator.block_tables == {"a": [0, 1]} and allocator.ref_counts == [1, 1, 0, 0]
    assert list(allocator.free_blocks) == [2, 3] and allocator.num_slots == {"a": 3}


def test_allocate_never_lowers_num_slots_on_the_fast_path():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    allocator.allocate("a", 3)
    allocator.allocate("a", 2)  # fits in the last block: the fast path
    assert allocator.num_slots["a"] == 3
    assert allocator.append_slot("a") == 3
