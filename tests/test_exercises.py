"""The exercises' checker: every case fails on the untouched stubs and passes on labkit's own implementation,
planted mistakes are reported with a message that points at them, and the references plugged into the
engine's seams give labkit's own tokens."""

from __future__ import annotations

import ast
import bisect
import functools
import hashlib
import itertools
import json
import operator
import os
import re
import signal
import struct
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import labkit.exercises.framework as framework
from labkit import Engine, EngineConfig, SamplingParams
from labkit.cli import main
from labkit.core import prefix_cache
from labkit.core.blocks import BlockAllocator, BlockEvent, NoFreeBlocksError, blocks_for
from labkit.core.prefix_cache import PrefixCache, PrefixMatch
from labkit.core.queues import ShortestFirstQueue
from labkit.core.request import RequestState
from labkit.core.scheduler import Scheduler, SchedulerOutput
from labkit.exercises import check, check_file, exercises, get, load_implementation, reference, start_exercise
from labkit.exercises.engine_runs import history
from labkit.runtime.attention import paged_attention, slot_mapping
from labkit.runtime.sampling import Sampler

STUBS = Path(__file__).resolve().parents[1] / "exercises"
NUMBERS = sorted(exercises())


def test_there_are_at_least_nine_exercises_each_with_a_stub_and_a_notebook():
    assert NUMBERS[:9] == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for number in NUMBERS:
        exercise = get(number)
        assert (STUBS / exercise.filename).is_file()
        assert (STUBS / exercise.filename.replace(".py", ".ipynb")).is_file()


def test_where_labkit_is_installed_without_the_repository_start_writes_the_stubs(tmp_path, monkeypatch, capsys):
    """On Colab a wheel has the stubs (labkit/exercises/stubs links to exercises/): start_exercise(N) puts them where
    check(N) looks, and never overwrites a learner's file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(framework, "LABKIT_DIR", tmp_path / "site-packages" / "labkit")  # no repository beside it
    monkeypatch.delenv(framework.EXERCISES_DIR_ENV, raising=False)
    assert "write the stubs here with start_exercise(1)" in check(1, quiet=True).load_error
    for number in NUMBERS:
        exercise = get(number)
        written = start_exercise(number)
        assert written == Path("exercises") / exercise.filename
        assert written.read_text() == (STUBS / exercise.filename).read_text()
        assert check(number, quiet=True).status == "not started"  # found there, every check waiting
    assert "Wrote the stubs of exercise 1 to exercises/ex1_block_allocator.py" in capsys.readouterr().out
    mine = Path("exercises") / get(1).filename
    mine.write_text("# my work\n")
    assert start_exercise(1) == Path.cwd() / "exercises" / get(1).filename and mine.read_text() == "# my work\n"
    assert "Your file for exercise 1 is exercises/ex1_block_allocator.py" in capsys.readouterr().out


def test_on_colab_start_says_how_to_check_and_keep_the_file(tmp_path, monkeypatch, capsys):
    """Colab has labkit but not the repository's tests, so pytest -m exN collects nothing there, and its runtime's
    files vanish when it is recycled: start_exercise says to check with labkit check and to save the file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(framework, "LABKIT_DIR", tmp_path / "site-packages" / "labkit")  # no repository beside it
    monkeypatch.delenv(framework.EXERCISES_DIR_ENV, raising=False)
    start_exercise(6)
    assert "On Colab" not in capsys.readouterr().out  # elsewhere, as before
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    (tmp_path / "exercises" / get(6).filename).unlink()
    for said in ("Wrote the stubs of exercise 6", "Your file for exercise 6 is"):  # written first, then found
        start_exercise(6)
        out = " ".join(capsys.readouterr().out.split())
        assert said in out and "check(6) in a cell" in out and "!labkit check 6" in out
        assert "pytest -m ex6 exercises/ needs the repository's tests, which Colab has not got" in out
        assert f"{(tmp_path / 'exercises' / get(6).filename).resolve()} lives on this runtime only" in out
        assert "downloading it from the file browser" in out and "Google Drive" in out


def test_start_refuses_stubs_that_hold_a_solution(tmp_path, monkeypatch):
    """The stubs travel in the wheel as links to exercises/: a wheel built from a checkout with solved exercises
    would hand its solutions to every learner as stubs. start_exercise refuses those instead of writing them."""
    import labkit.exercises as package

    solved = tmp_path / "package"
    (solved / "stubs").mkdir(parents=True)
    (solved / "stubs" / get(2).filename).write_text(DELEGATING_SLOT_MAPPING)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(framework, "LABKIT_DIR", tmp_path / "site-packages" / "labkit")  # no repository beside it
    monkeypatch.delenv(framework.EXERCISES_DIR_ENV, raising=False)
    monkeypatch.setattr(package, "files", lambda name: solved)
    with pytest.raises(RuntimeError, match="holds a solution, not stubs"):
        start_exercise(2)
    assert not (tmp_path / "exercises" / get(2).filename).exists()


@pytest.mark.parametrize("number", NUMBERS)
def test_every_case_fails_on_the_untouched_stub(number):
    result = check(number, path=STUBS, quiet=True)
    assert result.status == "not started"
    assert len(result.failures) == result.num_cases == len(get(number).cases)
    assert all(f.kind == "not started" for f in result.failures)
    assert not result.passed


@pytest.mark.parametrize("number", NUMBERS)
def test_every_case_passes_on_the_reference(number):
    result = check(number, reference(number), quiet=True)
    assert result.passed, result.report()
    assert result.status == "passed" and result.num_passed == result.num_cases


def test_the_references_are_labkits_own_implementation():
    assert reference(1) is BlockAllocator
    assert reference(2) is slot_mapping
    assert reference(3) is Scheduler and reference(4) is Scheduler and reference(7) is Scheduler
    assert reference(5) is paged_attention
    assert reference(6) is Sampler
    assert reference(8) is PrefixCache
    assert reference(9) is ShortestFirstQueue


def failing(number, implementation):
    result = check(number, implementation, quiet=True)
    assert not result.passed
    for failure in result.failures:  # a verdict always shows what differs
        assert failure.kind != "mismatch" or failure.expected != failure.got, failure.message()
    return result, {f.case: f.message() for f in result.failures}


def only_failure(number, implementation, case):
    """The message of ``case``, after checking that it is the one case ``implementation`` fails, besides the random
    cases: hypothesis draws their examples differently from one release to the next, and some draws show the mistake.
    """
    result, messages = failing(number, implementation)
    drawn = {f.case for f in result.failures if f.input.endswith("(the smallest counterexample hypothesis found)")}
    assert [name for name in messages if name == case or name not in drawn] == [case]
    return messages[case]


# ------------------------------------------------------------------ exercise 1: planted mistakes
class LeakyFree(BlockAllocator):
    """Forgets to return the last block of a request to the free queue."""

    def free(self, request_id):
        table = self.block_tables.pop(request_id)
        del self.num_slots[request_id]
        released = []
        for block in table[:-1]:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
                released.append(block)
                self.events.append(BlockEvent("free", block, request_id, self.step))
        return released


class GreedyAllocate(BlockAllocator):
    """Takes blocks one by one and only then finds out there are not enough: not all or nothing."""

    def allocate(self, request_id, num_tokens):
        needed = self.blocks_needed(request_id, num_tokens)
        table = self.block_tables.setdefault(request_id, [])
        new = []
        for _ in range(needed):
            if not self.free_blocks:
                raise NoFreeBlocksError("out of blocks")
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            self.events.append(BlockEvent("alloc", block, request_id, self.step))
            table.append(block)
            new.append(block)
        self.num_slots[request_id] = max(self.num_slots.get(request_id, 0), num_tokens)
        return new


class IgnoresRefCounts(BlockAllocator):
    """Frees every block of the request, even one another request still shares."""

    def free(self, request_id):
        table = self.block_tables.pop(request_id)
        del self.num_slots[request_id]
        for block in table:
            self.ref_counts[block] = 0
            self.free_blocks.append(block)
            self.events.append(BlockEvent("free", block, request_id, self.step))
        return list(table)


class SilentDoubleFree(BlockAllocator):
    def free(self, request_id):
        if request_id not in self.block_tables:
            return []
        return super().free(request_id)


class StepZero(BlockAllocator):
    """Records every event in step 0, whatever step the scheduler is planning."""

    def drain_events(self):
        return [event._replace(step=0) for event in super().drain_events()]


class KeepsNumSlots(BlockAllocator):
    """Frees the blocks but leaves the request in num_slots."""

    def free(self, request_id):
        slots = self.num_slots.get(request_id)
        released = super().free(request_id)
        self.num_slots[request_id] = slots
        return released


def test_ex1_a_free_that_keeps_num_slots_is_named_in_every_case_it_breaks():
    _, messages = failing(1, KeepsNumSlots)
    assert len(messages) > 1  # later frees see the stale entry too: each says so, not the case's own hint
    for text in messages.values():
        assert "num_slots: {" in text  # the field that differs is shown, expected against got
        assert "free removes the request from num_slots as well as from block_tables" in text


class NoTableForNoTokens(BlockAllocator):
    """Creates no block table for a request allocated 0 tokens."""

    def allocate(self, request_id, num_tokens, prefix=None):
        if num_tokens == 0 and request_id not in self.block_tables:
            return []
        return super().allocate(request_id, num_tokens, prefix)


def test_ex1_a_request_allocated_no_tokens_must_get_an_empty_table():
    _, messages = failing(1, NoTableForNoTokens)
    text = messages["allocate takes new blocks from the front of the free queue"]
    assert "allocate('c', 0)" in text and "'c': []" in text
    assert "gets its table all the same, empty, and num_slots 0" in text


def test_ex1_planted_mistakes_are_named():
    _, leak = failing(1, LeakyFree)
    text = leak["free gives every block back to the end of the free queue"]
    assert "free queue: [0, 1, 2]" in text and "free queue: [0, 1]" in text
    _, greedy = failing(1, GreedyAllocate)
    assert "all or nothing" in " ".join(greedy)
    assert "NoFreeBlocksError and leave the free queue" in greedy["allocate is all or nothing when blocks run out"]
    _, shared = failing(1, IgnoresRefCounts)
    assert "reference count drops to 0" in shared["a shared block stays in use until its last reference is freed"]
    _, double = failing(1, SilentDoubleFree)
    assert list(double) == ["free of a request that owns nothing raises KeyError", *list(double)[1:]]
    assert "raises KeyError" in double["free of a request that owns nothing raises KeyError"]
    _, step = failing(1, StepZero)
    text = step["every allocation and free is recorded as a BlockEvent"]
    assert "allocator.step = 3" in text and "('alloc', 0, 'a', 3)" in text and "('alloc', 0, 'a', 0)" in text
    assert "the allocator's current self.step" in text


class FreesToTheFront(BlockAllocator):
    """Puts each released block back at the front of the free queue (appendleft): reused first, not last."""

    in_order = False  # True: the released blocks go to the front in table order, else each one ahead of the last

    def free(self, request_id):
        table = self.block_tables.pop(request_id)
        del self.num_slots[request_id]
        released = []
        for block in table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                released.append(block)
                self.events.append(BlockEvent("free", block, request_id, self.step))
        self.free_blocks.extendleft(reversed(released) if self.in_order else released)
        return released


class FreesToTheFrontInOrder(FreesToTheFront):
    in_order = True


@pytest.mark.parametrize("planted", [FreesToTheFront, FreesToTheFrontInOrder])
def test_ex1_a_free_to_the_front_of_the_queue_is_named_by_the_queues_order(planted):
    _, messages = failing(1, planted)
    order = "a block freed now is handed out after every block already free"
    assert order in messages
    text = messages[order]
    assert "free('a')" in text and "free queue: [2, 3, 0, 1]" in text
    assert "first in, first out" in text and "append, not appendleft" in text
    assert "free of a request that owns nothing raises KeyError" not in messages
    for message in messages.values():  # every case it fails names the queue's order, none another mistake
        assert "first in, first out" in message, message


class FreesInReverse(BlockAllocator):
    """Releases the request's blocks last block first, as vLLM's free does (there for its eviction order)."""

    def free(self, request_id):
        table = self.block_tables.pop(request_id)
        del self.num_slots[request_id]
        released = []
        for block in reversed(table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:  # still shared
                self.events.append(BlockEvent("release", block, request_id, self.step))
                continue
            released.append(block)
            self.free_blocks.append(block)
            self.events.append(BlockEvent("free", block, request_id, self.step))
        return released


def test_ex1_a_free_in_reverse_table_order_is_named_in_every_case_it_breaks():
    _, messages = failing(1, FreesInReverse)
    assert "a shared block stays in use until its last reference is freed" in messages
    for message in messages.values():  # not "only when its reference count drops to 0", nor the case's own rule
        assert "in table order, its first block first (not reversed)" in message, message


class AllocateWithoutRefCounts(BlockAllocator):
    """Takes the right blocks but leaves their reference counts at 0."""

    def allocate(self, request_id, num_tokens, prefix=None):
        new = super().allocate(request_id, num_tokens, prefix)
        for block in new:
            self.ref_counts[block] = 0
        return new


def test_ex1_reference_counts_left_at_0_are_named_not_each_cases_own_rule():
    _, messages = failing(1, AllocateWithoutRefCounts)
    replayed = [name for name in messages if not name.startswith("inside the engine")]
    assert len(replayed) >= 8  # every replayed case fails at the first allocate, on the reference counts alone
    for name in replayed:
        text = messages[name]
        assert "ref counts: [1" in text and "ref counts: [0" in text
        assert "allocate sets it to 1 for each block it takes" in text, text
        assert "must raise KeyError" not in text and "first in, first out" not in text


class ReplacesTable(BlockAllocator):
    """Sets the request's block table to the new blocks alone instead of growing the one it has."""

    def allocate(self, request_id, num_tokens, prefix=None):
        new = super().allocate(request_id, num_tokens, prefix)
        self.block_tables[request_id] = list(new)
        return new


def test_ex1_a_table_replaced_instead_of_grown_is_named_even_where_labkits_append_slot_stops():
    _, messages = failing(1, ReplacesTable)
    for name in (
        "allocate adds only the blocks a request still lacks",
        "a shared block stays in use until its last reference is freed",
    ):
        assert "append the new blocks to the end of the table the request already has" in messages[name]
    text = messages["every allocation and free is recorded as a BlockEvent"]
    assert "your code raised" not in text  # the IndexError is labkit's slot(), reached through the learner's allocate
    assert "raises IndexError (list index out of range) in labkit's append_slot" in text
    assert "block tables: {'a': [0, 1]}" in text and "block tables: {'a': []}" in text
    assert "append the new blocks to the end of the table the request already has" in text
    text = messages["inside the engine, the allocator serves requests through preemptions and gets every block back"]
    assert "grows the table [0]" in text and "left the table []" in text and "free must give" not in text
    assert "append the new blocks to the end of the table the request already has" in text


class AppendSlotThroughBrokenAllocate(BlockAllocator):
    """Right until append_slot calls allocate for one more token, where the learner's own code raises."""

    def allocate(self, request_id, num_tokens, prefix=None):
        if request_id in self.num_slots and num_tokens == self.num_slots[request_id] + 1:
            return self.missing_attribute
        return super().allocate(request_id, num_tokens, prefix)


def test_ex1_the_learners_own_error_inside_append_slot_stays_the_learners():
    _, messages = failing(1, AppendSlotThroughBrokenAllocate)
    text = messages["every allocation and free is recorded as a BlockEvent"]
    assert "your code raised AttributeError" in text and "in labkit's append_slot" not in text


class TwoArgumentAllocate(BlockAllocator):
    """Right in every direct call, but declares allocate(request_id, num_tokens) without the engine's prefix."""

    def allocate(self, request_id, num_tokens):
        return super().allocate(request_id, num_tokens)


def test_ex1_an_allocator_that_the_engine_cannot_call_is_named_by_the_engine_case():
    engine = "inside the engine, the allocator serves requests through preemptions and gets every block back"
    text = only_failure(1, TwoArgumentAllocate, engine)
    assert "takes 3 positional arguments but 4 were given" in text
    assert "allocate(request_id, num_tokens, prefix)" in text


def test_ex1_a_leaky_free_inside_the_engine_is_stopped_and_named():
    _, messages = failing(1, LeakyFree)
    text = messages["inside the engine, the allocator serves requests through preemptions and gets every block back"]
    assert "requests unfinished after 400 steps" in text and "or the cache runs dry" in text


class TakesOneBlockTooMany(BlockAllocator):
    """Takes one block more than it needs off the free queue whenever it takes any, and records only those it needs."""

    def allocate(self, request_id, num_tokens, prefix=None):
        new = super().allocate(request_id, num_tokens, prefix)
        if new and self.free_blocks:
            self.free_blocks.popleft()
        return new


class RecordsOnlyTheFirstNewBlock(BlockAllocator):
    """Takes the blocks it needs off the free queue, but appends only the first of them to the request's table."""

    def allocate(self, request_id, num_tokens, prefix=None):
        new = super().allocate(request_id, num_tokens, prefix)
        del self.block_tables[request_id][len(self.block_tables[request_id]) - len(new) + 1 :]
        return new


@pytest.mark.parametrize("planted", [TakesOneBlockTooMany, RecordsOnlyTheFirstNewBlock])
def test_ex1_blocks_that_allocate_loses_are_named_as_allocates_not_frees(planted):
    _, messages = failing(1, planted)
    text = messages["inside the engine, the allocator serves requests through preemptions and gets every block back"]
    assert re.search(r"got: +after allocate\(\d+, \d+\) in step 1, block \d+ is in neither the free queue", text)
    assert "allocate took block" in text and "append each one you take to the end of the request's table" in text
    assert "free must give every block" not in text
    text = messages["a block freed now is handed out after every block already free"]  # a replayed case
    assert "allocate('a', 4)" in text and "free('a')" not in text
    assert "without putting it in a block table" in text and "first in, first out" not in text


class TakesThenRaises(BlockAllocator):
    """Takes blocks off the free queue one at a time and raises when it runs dry, keeping what it took."""

    def allocate(self, request_id, num_tokens, prefix=None):
        taken = [self.free_blocks.popleft() for _ in range(min(self.blocks_needed(request_id, num_tokens),
                                                                len(self.free_blocks)))]  # fmt: skip
        if len(taken) < self.blocks_needed(request_id, num_tokens):
            raise NoFreeBlocksError(f"{request_id!r} needs more blocks than are free")
        self.free_blocks.extendleft(reversed(taken))
        return super().allocate(request_id, num_tokens, prefix)


def test_ex1_blocks_taken_before_allocate_raises_are_named_as_breaking_all_or_nothing():
    _, messages = failing(1, TakesThenRaises)
    assert sorted(messages) == [
        "allocate is all or nothing when blocks run out",
        "random allocate/free/append_slot sequences behave like labkit's allocator",
    ]
    assert (
        "allocate took blocks [2, 3] off the free queue and then raised"
        in messages["allocate is all or nothing when blocks run out"]
    )
    for text in messages.values():
        assert "then raised: check that enough blocks are free before taking any" in text
        assert "append each one you take" not in text


class RaisesWithExactlyEnough(BlockAllocator):
    """Raises NoFreeBlocksError when as many blocks are needed as are free (>= where the contract says >)."""

    def allocate(self, request_id, num_tokens, prefix=None):
        needed = self.blocks_needed(request_id, num_tokens)
        if needed >= len(self.free_blocks) and needed > 0:
            raise NoFreeBlocksError(f"{request_id!r} needs {needed} blocks")
        return super().allocate(request_id, num_tokens, prefix)


def test_ex1_an_allocate_that_raises_with_exactly_enough_blocks_free_is_named():
    _, messages = failing(1, RaisesWithExactlyEnough)
    text = messages["allocate is all or nothing when blocks run out"]
    assert "allocate('b', 8)" in text and "expected: returns [2, 3]" in text
    assert "got:      raises NoFreeBlocksError" in text
    engine = "inside the engine, the allocator serves requests through preemptions and gets every block back"
    assert "raised NoFreeBlocksError" in messages[engine]
    for text in messages.values():
        assert "exactly enough free blocks is enough: raise only when more are needed than are free" in text, text
        assert "check that enough blocks are free before taking any" not in text


class FreeEventForASharedBlock(BlockAllocator):
    """Records a "free" event for every block of the request, also one that another request still holds."""

    def free(self, request_id):
        table = list(self.block_tables[request_id])
        released = super().free(request_id)
        kept = len(self.events) - len(table)
        self.events[kept:] = [BlockEvent("free", block, request_id, self.step) for block in table]
        return released


def test_ex1_a_free_event_for_a_block_that_stays_shared_is_named():
    text = only_failure(1, FreeEventForASharedBlock, "a shared block stays in use until its last reference is freed")
    assert "free('a')" in text and "('release', 0, 'a', 0)" in text and "('free', 0, 'a', 0)" in text
    assert "it gets a BlockEvent('release', block, request_id, self.step), not 'free'" in text


def test_ex1_the_stub_says_which_event_a_block_that_stays_shared_gets():
    free = (STUBS / get(1).filename).read_text().split("def free", 1)[1]
    assert '"release" event' in free and 'BlockEvent("release", block, request_id, self.step)' in free


class AllocateReturnsATuple(BlockAllocator):
    def allocate(self, request_id, num_tokens, prefix=None):
        return tuple(super().allocate(request_id, num_tokens, prefix))


def test_ex1_an_allocate_that_returns_no_list_is_told_to_return_one():
    _, messages = failing(1, AllocateReturnsATuple)
    assert len(messages) > 3
    for name, text in messages.items():
        if not name.startswith("inside the engine"):
            assert "return a list of block ids" in text and "not a tuple" in text, text
    text = messages["allocate takes new blocks from the front of the free queue"]
    assert "expected: returns [0, 1]" in text and "got:      returns (0, 1)" in text


class CountsBlocks(BlockAllocator):
    """allocate written from the contract, but with its own count of the blocks num_tokens fill."""

    @staticmethod
    def count(num_tokens, block_size):
        return blocks_for(num_tokens, block_size)

    def allocate(self, request_id, num_tokens, prefix=None):
        table = self.block_tables.get(request_id, [])
        needed = max(0, self.count(num_tokens, self.block_size) - len(table))
        if needed > len(self.free_blocks):
            raise NoFreeBlocksError(f"{request_id!r} needs {needed} blocks")
        new = [self.free_blocks.popleft() for _ in range(needed)]
        for block in new:
            self.ref_counts[block] = 1
            self.events.append(BlockEvent("alloc", block, request_id, self.step))
        self.block_tables[request_id] = table + new
        self.num_slots[request_id] = max(self.num_slots.get(request_id, 0), num_tokens)
        return new


class DropsThePartialBlock(CountsBlocks):
    """num_tokens // block_size blocks: the last, partly filled block is never taken."""

    @staticmethod
    def count(num_tokens, block_size):
        return num_tokens // block_size


class TakesABlockPastAFullOne(CountsBlocks):
    """num_tokens // block_size + 1 blocks: one too many whenever num_tokens fills its blocks exactly."""

    @staticmethod
    def count(num_tokens, block_size):
        return num_tokens // block_size + 1


def test_ex1_an_allocate_that_drops_the_last_partial_block_is_told_it_takes_too_few():
    _, messages = failing(1, DropsThePartialBlock)
    for text in messages.values():
        assert "num_tokens // block_size drops that last, partial block" in text, text
        assert "instead of replacing the table" not in text
    text = messages["allocate adds only the blocks a request still lacks"]  # the request had no table: none replaced
    assert "block tables: {'a': [0]}" in text and "block tables: {'a': []}" in text
    assert "allocate('a', 3) took 0 blocks where 1 is needed" in text
    text = messages["inside the engine, the allocator serves requests through preemptions and gets every block back"]
    assert "allocate(0, 3) in step 1 took 0 blocks where 1 is needed" in text


def test_ex1_an_allocate_that_takes_a_block_too_many_is_not_told_it_raised_at_an_exact_fit():
    _, messages = failing(1, TakesABlockPastAFullOne)
    assert len(messages) == len(get(1).cases)
    text = messages["free gives every block back to the end of the free queue"]
    assert "expected: returns [3]" in text and "got:      raises NoFreeBlocksError" in text
    assert "allocate('b', 2) needs 1 block and 1 is free, yet it raised NoFreeBlocksError" in text
    assert "given enough free blocks it takes 2" in text
    text = messages["free of a request that owns nothing raises KeyError"]
    assert "allocate('a', 4) needs 1 block and 1 is free, yet it raised NoFreeBlocksError" in text
    text = messages["a block freed now is handed out after every block already free"]
    assert "allocate('a', 4) took 3 blocks where 2 are needed" in text
    text = messages["every allocation and free is recorded as a BlockEvent"]
    assert "allocate('a', 4) (called by append_slot('a')) took 1 block where 0 are needed" in text
    for text in messages.values():
        assert "takes one too many when num_tokens fills its blocks exactly" in text, text
        assert "exactly enough free blocks is enough" not in text and "first in, first out" not in text
        assert "must raise KeyError" not in text


class FreeNotStarted(BlockAllocator):
    """allocate is labkit's; free still raises, as the stub's does."""

    def free(self, request_id):
        raise NotImplementedError("Exercise 1")


def test_a_method_not_started_is_named_when_the_other_one_is_done():
    result, _ = failing(1, FreeNotStarted)
    waiting = [f for f in result.failures if f.kind == "not started"]
    assert waiting and result.status == "failing"
    for failure in waiting:
        assert failure.message() == f"· {failure.case}: not started: free() still raises NotImplementedError"
    assert "free() still raises NotImplementedError" in result.report()


# ------------------------------------------------------------------ exercise 2
def slots_from_zero(segments, block_size, scratch):
    return slot_mapping([s._replace(start=0) for s in segments], block_size, scratch)


def slots_without_table(segments, block_size, scratch):
    return slot_mapping([s._replace(block_table=range(99)) for s in segments], block_size, scratch)


def slots_padding_real(segments, block_size, scratch):
    return slot_mapping([s._replace(writes_cache=True, block_table=range(99)) for s in segments], block_size, scratch)


def slots_without_block_size(segments, block_size, scratch):
    """block_table[p // block_size] + p % block_size: forgets to multiply the block by block_size."""
    slots = []
    for s in segments:
        for p in range(s.start, s.start + s.num_tokens):
            slots.append(s.block_table[p // block_size] + p % block_size if s.writes_cache else scratch)
    return slots


def slots_from_the_last_table(segments, block_size, scratch):
    return slot_mapping([s._replace(block_table=segments[-1].block_table) for s in segments], block_size, scratch)


def test_ex2_planted_mistakes_are_named():
    _, zero = failing(2, slots_from_zero)
    assert "start from s.start" in zero["a chunk that starts mid-block begins at its start position"]
    _, table = failing(2, slots_without_table)
    assert "ignore the block table" in table["a decode token is found through the block table"]
    _, padding = failing(2, slots_padding_real)
    assert "every one of its tokens goes to scratch_slot" in padding["padding rows write to the scratch slot"]


def slots_adding_the_position(segments, block_size, scratch):
    """block_table[p // block_size] * block_size + p: the position in place of its offset in the block."""
    return [
        s.block_table[p // block_size] * block_size + p if s.writes_cache else scratch
        for s in segments
        for p in range(s.start, s.start + s.num_tokens)
    ]


def slots_a_block_early_on_a_boundary(segments, block_size, scratch):
    """block_table[(p - 1) // block_size]: a position on a block boundary goes to the block before."""
    return [
        s.block_table[(p - 1) // block_size] * block_size + p % block_size if s.writes_cache else scratch
        for s in segments
        for p in range(s.start, s.start + s.num_tokens)
    ]


def slots_without_padding(segments, block_size, scratch):
    return slot_mapping([s for s in segments if s.writes_cache], block_size, scratch)


def test_ex2_the_position_for_its_offset_a_boundary_and_missing_padding_are_named():
    _, position = failing(2, slots_adding_the_position)
    assert (
        "add the position p inside its block, not its offset p % block_size"
        in position["a decode token is found through the block table"]
    )
    text = position["a chunk that starts mid-block begins at its start position"]
    assert "start + i, not i" not in text  # this learner did start from s.start: that rule is not named as broken
    _, boundary = failing(2, slots_a_block_early_on_a_boundary)
    assert "Every wrong slot is at a position on a block boundary" in boundary["a prompt crosses block boundaries"]
    _, padding = failing(2, slots_without_padding)
    assert "you returned 1 slot for 4 packed tokens" in padding["padding rows write to the scratch slot"]


def slots_one_past(segments, block_size, scratch):
    return [slot + 1 if slot != scratch else slot for slot in slot_mapping(segments, block_size, scratch)]


def test_ex2_a_block_boundary_is_named_only_where_a_slot_inside_a_block_came_out_right():
    """A case of one token at position 0 has every real position on a boundary: any mistake there would be named
    as a boundary mistake, which these are not."""
    for planted in (slots_one_past, slots_without_block_size):
        _, messages = failing(2, planted)
        first = messages["a prompt's first token goes to the first slot of its first block"]
        assert "block boundary" not in first
    _, messages = failing(2, slots_without_block_size)
    for name in (
        "a prompt's first token goes to the first slot of its first block",
        "a prompt crosses block boundaries",
    ):
        assert "block b starts at slot b * block_size" in messages[name]
    _, boundary = failing(2, slots_a_block_early_on_a_boundary)
    assert "block boundary" in boundary["a chunk that starts mid-block begins at its start position"]


def test_ex2_a_tensor_in_place_of_a_list_is_named():
    _, messages = failing(
        2, lambda segments, block_size, scratch: torch.tensor(slot_mapping(segments, block_size, scratch))
    )
    for text in messages.values():  # every case: the values are right, the type is not
        assert "got:      a Tensor: tensor([" in text and "tensor.tolist() makes one" in text


def test_ex2_a_diagnosis_that_cannot_run_is_not_the_learners_error():
    # Replaying "padding got real slots" on these segments needs blocks their tables lack: labkit's own
    # slot_mapping raises there, which must neither be blamed on the learner nor hide the real mismatch.
    for planted, got in ((slots_without_block_size, "[9, 999, 999, 999]"), (slots_from_the_last_table, "[18, 999")):
        _, messages = failing(2, planted)
        text = messages["padding rows write to the scratch slot"]
        assert "raised" not in text and "expected: [30, 999, 999, 999]" in text and f"got:      {got}" in text
        assert "(segment 0, position 2). " in text and "position p of a request lives in slot" in text


# ------------------------------------------------------------------ exercise 3
class LearnerScheduler(Scheduler):
    """A plan-only schedule_continuous written from the contract; the subclasses below plant one mistake each."""

    overspend = 0
    prefill_first = False
    max_seqs = True
    prompt_only = False  # admit a request with its prompt alone, not its prompt and generated tokens
    preempts_itself = True  # the youngest request, short of a block, is its own victim and gets no chunk
    skips_ahead = False  # admission passes a waiting request that cannot start, for a later one
    evicts_first = True  # a rolled-back step's victims are preempted again before anything runs
    skips_finished = True  # of self.evict_first, only the requests not finished since are the last running ones
    admits_after_evicting = False  # admits in a step that preempted only self.evict_first's victims
    labels = True  # a chunk is a prefill while its request is PREFILLING
    spare_block = 0  # 1: preempts while a request needs as many blocks as are free, not more
    empty_chunks = False  # admits with a budget of 0, planning chunks of no tokens
    restarts = False  # a running request's chunk starts at token 0, not at its num_computed_tokens

    def schedule_continuous(self):
        cfg, allocator = self.config, self.allocator
        output = SchedulerOutput(step=self.step_index + 1, chunks=[])
        budget = cfg.max_batch_tokens + self.overspend
        if self.prefill_first:
            budget = self.admit_waiting(output, budget)
        live = len(self.running)  # running[live:] are this step's victims
        evict = [r for r in self.evict_first if r.state is not RequestState.FINISHED or not self.skips_finished]
        evict = evict if self.evicts_first else []
        runnable = live - len(evict)  # running[:runnable] may run
        i = 0
        while i < min(runnable, live) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            n = min(remaining, budget)
            if n < remaining and not cfg.chunked_prefill:
                i += 1
                continue
            end = request.num_computed_tokens + n
            last_victim = i if self.preempts_itself else i + 1
            free = allocator.num_free_blocks - self.spare_block
            while allocator.blocks_needed(request.request_id, self.covered(request, n)) > free and live > last_victim:
                live -= 1
                self.preempt(output, self.running[live])
                free = allocator.num_free_blocks - self.spare_block
            if live == i:
                break
            allocator.allocate(request.request_id, end)
            prefill = self.is_prefill(request, n)
            output.add_chunk(request, 0 if self.restarts else request.num_computed_tokens, n, prefill)
            budget -= n
            i += 1
        preempted_in_walk = bool(output.preempted)
        while live > runnable:
            live -= 1
            self.preempt(output, self.running[live])
        stop = preempted_in_walk if self.admits_after_evicting else output.preempted
        if not self.prefill_first and not stop:
            self.admit_waiting(output, budget)
        return output

    def covered(self, request, n):
        """How many tokens a running request's table must cover before its chunk of n is planned."""
        return request.num_computed_tokens + n

    def is_prefill(self, request, n):
        """The label of a running request's chunk of n tokens."""
        return request.state is RequestState.PREFILLING and self.labels

    def first_chunk(self, request, n):
        """How many tokens admission asks the allocator about for a first chunk of n."""
        return n

    def admit_waiting(self, output, budget):
        for request in self.waiting:
            seats = not self.max_seqs or len(self.running) + len(output.admitted) < self.config.max_num_seqs
            if (budget <= 0 and not self.empty_chunks) or not seats:
                break
            wanted = request.num_prompt_tokens if self.prompt_only else request.num_tokens
            n = min(wanted, budget)
            if n < wanted and not self.config.chunked_prefill:
                break
            if not self.allocator.can_allocate(request.request_id, self.first_chunk(request, n)):
                if self.skips_ahead:
                    continue
                break
            self.allocator.allocate(request.request_id, n)
            output.admitted.append(request)
            output.add_chunk(request, 0, n, True)
            budget -= n
        return budget


class RestartsRunning(LearnerScheduler):
    restarts = True


def test_ex3_a_running_chunk_that_does_not_continue_from_num_computed_tokens_is_named():
    _, messages = failing(3, RestartsRunning)
    text = messages["a lone prompt is prefilled in one step, then decodes one token a step"]
    assert "expected: step 2: decode r0 [6:7]" in text and "got:      step 2: decode r0 [0:1]" in text
    assert "r0 is running with 6 tokens computed, so its chunk starts at token 6, not 0" in text
    for message in messages.values():
        assert "continues from request.num_computed_tokens" in message, message


class AdmitsAfterPreempting(LearnerScheduler):
    def schedule_continuous(self):
        output = super().schedule_continuous()
        if output.preempted:
            self.admit_waiting(output, self.config.max_batch_tokens - sum(c.num_tokens for c in output.chunks))
        return output


class AdmitsThePromptOnly(LearnerScheduler):
    """Admits a request with its prompt alone, so a preempted one does not recompute its generated tokens."""

    prompt_only = True


class PreemptsTheOldest(LearnerScheduler):
    """Takes each victim from the front of self.running: the request just scheduled, even the one asking."""

    def schedule_continuous(self):
        allocator = self.allocator
        output = SchedulerOutput(step=self.step_index + 1, chunks=[])
        budget = self.config.max_batch_tokens
        for request in self.running:
            if budget <= 0 or request in output.preempted:
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            end = request.num_computed_tokens + n
            while allocator.blocks_needed(request.request_id, end) > allocator.num_free_blocks:
                self.preempt(output, next(r for r in self.running if r not in output.preempted))
            allocator.allocate(request.request_id, end)
            output.add_chunk(request, request.num_computed_tokens, n, request.state is RequestState.PREFILLING)
            budget -= n
        if not output.preempted:
            self.admit_waiting(output, budget)
        return output


class PopsTheQueue(LearnerScheduler):
    """Takes the admitted requests off self.waiting while planning, as update() does once more later."""

    def admit_waiting(self, output, budget):
        budget = super().admit_waiting(output, budget)
        for _ in output.admitted:
            self.waiting.popleft()
        return budget


class MarksAdmittedWhilePlanning(LearnerScheduler):
    """Sets an admitted request's state while planning, as update() does once the step has run."""

    def admit_waiting(self, output, budget):
        budget = super().admit_waiting(output, budget)
        for request in output.admitted:
            request.state = RequestState.PREFILLING
        return budget


class OverspendsByOne(LearnerScheduler):
    overspend = 1


class PrefillFirst(LearnerScheduler):
    prefill_first = True


class IgnoresMaxNumSeqs(LearnerScheduler):
    max_seqs = False


class NeverPreemptsItself(LearnerScheduler):
    """Preempts only requests younger than the one that needs a block, then allocates for it regardless."""

    preempts_itself = False


class SkipsAheadInTheQueue(LearnerScheduler):
    """Admits any waiting request that fits, passing one that does not."""

    skips_ahead = True


class IgnoresEvictFirst(LearnerScheduler):
    """Lets a rolled-back step's victim run again on blocks that step may have written into."""

    evicts_first = False


class EvictsAllItLists(LearnerScheduler):
    """Counts every request self.evict_first lists as one of the last running ones, also one aborted since."""

    skips_finished = False


class AdmitsAfterEvicting(LearnerScheduler):
    """Skips admission after a preemption for blocks, but admits in a step that preempts self.evict_first's alone."""

    admits_after_evicting = True


class ForgetsToReturn(LearnerScheduler):
    def schedule_continuous(self):
        super().schedule_continuous()


class LabelsEveryChunkDecode(LearnerScheduler):
    """Passes is_prefill=False for a running request's prompt chunks."""

    labels = False


class PreemptsOneBlockEarly(LearnerScheduler):
    """Preempts while a request needs as many blocks as are free, though they would do."""

    spare_block = 1


class PlansEmptyChunks(LearnerScheduler):
    """Goes on admitting once the budget is spent, with chunks of no tokens."""

    empty_chunks = True


class LabelsByChunkLength(LearnerScheduler):
    """Calls a chunk a prefill when it has more than one token left to compute: a prompt's last token is a decode."""

    def is_prefill(self, request, n):
        return request.num_tokens - request.num_computed_tokens > 1


class LabelsByPrompt(LearnerScheduler):
    """Calls a chunk a prefill while the request's prompt is not all computed: a recomputation's later chunks decode."""

    def is_prefill(self, request, n):
        return request.num_computed_tokens < request.num_prompt_tokens


class AsksForTheWholePrompt(LearnerScheduler):
    """Admits a request only when the blocks of all its tokens are free, not those of its first chunk."""

    def first_chunk(self, request, n):
        return request.num_tokens


class AsksAboutTheChunkAlone(LearnerScheduler):
    """Asks blocks_needed about the chunk's n tokens, not num_computed_tokens + n: it never preempts."""

    def covered(self, request, n):
        return n


@pytest.mark.parametrize(
    ("planted", "case", "says"),
    [
        (
            LabelsByChunkLength,
            "a prompt's last chunk of one token is still a prefill",
            [
                "expected: step 2: prefill r0 [12:13]",
                "got:      step 2: decode r0 [12:13]",
                "r0's chunk [12:13] is a prefill: a prompt's last chunk may be a single token",
            ],
        ),
        (
            LabelsByPrompt,
            "a request recomputed after preemption prefills all its tokens, chunk by chunk",
            [
                "step 4: decode r0 [4:5]; preempted [1]",
                "step 5: decode r0 [5:6]; prefill r1 [0:8]; admitted [1]",
                "expected: step 6: prefill r1 [8:10]",
                "got:      step 6: decode r1 [8:10]",
                "r1 was preempted, so it recomputes the tokens it generated as well as its prompt, and this chunk lies"
                " past its 7-token prompt",
            ],
        ),
    ],
)
def test_ex3_a_prefill_chunk_labelled_a_decode_is_told_what_misled_the_label(planted, case, says):
    text = only_failure(3, planted, case)
    for line in says:
        assert line in text, text
    assert "not by how many tokens it has, nor by whether it lies within the prompt" in text


def test_ex3_an_admission_that_asks_for_the_whole_prompts_blocks_is_named():
    _, messages = failing(3, AsksForTheWholePrompt)
    first = messages["admission needs the blocks of the first chunk, not of the whole prompt"]
    recomputed = messages["a request recomputed after preemption prefills all its tokens, chunk by chunk"]
    assert "your code asked allocator.can_allocate(1, 10)" in recomputed  # all 10 tokens, not the 8 of its chunk
    assert first.count("with n = min(request.num_tokens, budget)") == 1  # the case's rule, said once
    for line in (
        "expected: step 1: prefill r0 [0:4]; prefill r1 [0:4]; admitted [0, 1]",
        "got:      step 1: prefill r0 [0:4]; admitted [0]",
        "r1 can start with a chunk of 4 tokens, but your code asked allocator.can_allocate(1, 14)",
    ):
        assert line in first, first


def test_ex3_a_running_request_out_of_blocks_after_asking_about_its_chunk_alone_is_named():
    _, messages = failing(3, AsksAboutTheChunkAlone)
    for text in messages.values():
        assert "request.num_computed_tokens + n, as allocate does" in text, text
        assert "admit a request only if self.allocator.can_allocate" not in text and "_BadPlan" not in text
    text = messages["the youngest request, needing a block when none is free, preempts itself and runs nothing"]
    assert all(
        line in text
        for line in (
            "expected: step 6: decode r0 [8:9]; preempted [1]",
            "got:      your code raised NoFreeBlocksError: request 1 needs 1 blocks, only 0 free",
            "in schedule_continuous",  # where the learner's code raised
            "your code asked allocator.blocks_needed(1, 1) but allocates 9 tokens for r1",
        )
    ), text


def test_ex3_a_scheduler_written_from_the_contract_passes():
    assert check(3, LearnerScheduler, quiet=True).passed


@pytest.mark.parametrize(
    ("planted", "case", "says"),
    [
        (
            OverspendsByOne,
            "a step never schedules more than max_batch_tokens",
            ["schedules 17 tokens, but max_batch_tokens is 16"],
        ),
        (
            PrefillFirst,
            "running requests decode before new prompts are admitted",
            ["got:      step 2: prefill r2 [0:10]", "only then admit from self.waiting"],
        ),
        (IgnoresMaxNumSeqs, "max_num_seqs caps the running requests", ["but max_num_seqs is 2"]),
        (
            AdmitsAfterPreempting,
            "admission stops when the free blocks run out",
            ["step 2 preempts [1] and admits [2]", "a step that preempts admits nothing new"],
        ),
        (
            AdmitsThePromptOnly,
            "a request that needs a block when none is free preempts the youngest",
            [
                "expected: step 11: prefill r2 [0:13]",
                "got:      step 11: prefill r2 [0:6]",
                "recomputes all its request.num_tokens (its prompt and the tokens it generated)",
            ],
        ),
        (
            NeverPreemptsItself,
            "the youngest request, needing a block when none is free, preempts itself and runs nothing",
            ["your code raised NoFreeBlocksError", "it gets no chunk this step: stop the walk"],
        ),
        (
            SkipsAheadInTheQueue,
            "admission stops at the first waiting request that cannot start",
            ["got:      step 1: prefill r0 [0:8]; prefill r2 [0:3]", "jump the queue"],
        ),
        (
            IgnoresEvictFirst,
            "a rolled-back step's victims are preempted before anything runs",
            [
                "expected: step 8: decode r1 [12:13]; preempted [2]",
                "got:      step 8: decode r1 [12:13]; decode r2 [12:13]",
                "self.evict_first lists them",
            ],
        ),
        (
            LabelsEveryChunkDecode,
            "with chunked prefill a long prompt is split across steps",
            [
                "expected: step 2: prefill r0 [12:24]",
                "got:      step 2: decode r0 [12:24]",
                "a chunk is a prefill while its request is PREFILLING",
            ],
        ),
    ],
)
def test_ex3_planted_mistakes_are_named(planted, case, says):
    _, messages = failing(3, planted)
    for text in says:
        assert text in messages[case], messages[case]


def test_ex3_a_rolled_back_victim_aborted_since_is_not_counted_among_the_last_running():
    case = "a rolled-back step's victim that finished since is not preempted again"
    text = only_failure(3, EvictsAllItLists, case)
    assert "then r2 is aborted (self.evict_first still lists it)" in text
    assert "expected: step 8: decode r0 [12:13]; decode r1 [12:13]" in text
    assert "got:      step 8: decode r0 [12:13]; preempted [1]" in text
    assert "Count only the listed requests not finished since" in text and "RequestState.FINISHED" in text


def test_ex3_a_step_that_preempts_a_rolled_back_steps_victims_and_admits_is_named():
    case = "a step that preempts a rolled-back step's victims admits nothing"
    text = only_failure(3, AdmitsAfterEvicting, case)
    assert "then r0 is aborted, which leaves r3 a seat and free blocks" in text
    assert "got:      step 8 preempts [2] and admits [3]" in text
    assert "a step that preempts admits nothing new" in text and "self.evict_first" in text


def test_a_scheduler_that_returns_no_plan_is_told_to_return_it():
    _, messages = failing(3, ForgetsToReturn)
    assert len(messages) == len(get(3).cases)
    for text in messages.values():
        assert "step 1: schedule_continuous returned None" in text, text
        assert "return the SchedulerOutput you filled" in text and "labkit raised" not in text


def test_ex3_a_plan_labkit_cannot_carry_out_is_named_before_the_model_runs():
    _, oldest = failing(3, PreemptsTheOldest)
    text = oldest["a request that needs a block when none is free preempts the youngest"]
    assert "got:      step 8 schedules r0 [12:13] and also preempts r0" in text and "raised" not in text
    assert "never a request you have already given a chunk" in text
    _, pops = failing(3, PopsTheQueue)
    text = pops["a lone prompt is prefilled in one step, then decodes one token a step"]
    assert "got:      planning step 1 changed the waiting queue: [0] -> []" in text and "your code raised" not in text
    assert "never pop from or append to the queues" in text


def test_ex3_a_step_that_differs_in_whom_it_preempts_says_so_before_what_its_case_checks():
    _, messages = failing(3, PreemptsOneBlockEarly)
    text = messages["admission stops at the first waiting request that cannot start"]
    assert "got:      step 6: nothing; preempted [2, 1]" in text
    assert text.index("the steps differ in whom they preempt") < text.index("What this case checks: admit from")
    _, messages = failing(3, AdmitsThePromptOnly)
    text = messages["admission stops at the first waiting request that cannot start"]
    assert "r2 was preempted earlier, so it starts again from token 0" in text and "jump the queue" in text
    _, messages = failing(3, IgnoresEvictFirst)  # a rolled-back step's victims: its own hint, not a diagnosis
    assert "whom they preempt" not in messages["a rolled-back step's victims are preempted before anything runs"]


def test_ex3_a_plan_that_changes_a_request_is_named_before_the_model_runs():
    _, messages = failing(3, MarksAdmittedWhilePlanning)
    text = messages["a lone prompt is prefilled in one step, then decodes one token a step"]
    assert "got:      planning step 1 changed r0: WAITING, 0 computed, 0 generated -> PREFILLING" in text
    assert "never change a request" in text


def test_ex3_a_chunk_of_no_tokens_is_named():
    _, messages = failing(3, PlansEmptyChunks)
    text = messages["requests are admitted in arrival order while the budget allows"]
    assert "got:      step 1 schedules r3 [0:0], a chunk of 0 tokens" in text
    assert "a chunk is at least one token" in text


def test_ex3_the_notebooks_name_only_what_a_scheduler_has():
    scheduler = Scheduler(EngineConfig(num_blocks=8), BlockAllocator(8, 4))
    for number in (3, 4, 7):
        notebook = json.loads((STUBS / get(number).filename.replace(".py", ".ipynb")).read_text())
        prose = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
        named = set(re.findall(r"self\.(\w+)", prose))
        assert {name for name in named if not hasattr(scheduler, name)} == set(), number


# ------------------------------------------------------------------ exercise 4
class KeepsComputedTokens(Scheduler):
    def requeue_preempted(self, victim):
        computed = victim.num_computed_tokens
        super().requeue_preempted(victim)
        victim.num_computed_tokens = computed


class NotListed(Scheduler):
    def preempt(self, output, victim):
        self.allocator.free(victim.request_id)


class RequeuesAtTheBack(Scheduler):
    def requeue_preempted(self, victim):
        super().requeue_preempted(victim)
        self.waiting.remove(victim)
        self.waiting.append(victim)


class KeepsItsBlocks(Scheduler):
    def preempt(self, output, victim):
        output.preempted.append(victim)


class PlansTheCommit(Scheduler):
    """Changes the victim while planning; requeue_preempted only puts it back in the queue."""

    def preempt(self, output, victim):
        super().preempt(output, victim)
        victim.state = RequestState.WAITING
        victim.num_computed_tokens = 0
        victim.metrics.num_preemptions += 1

    def requeue_preempted(self, victim):
        self.waiting.appendleft(victim)


def test_ex4_planted_mistakes_are_named():
    _, computed = failing(4, KeepsComputedTokens)
    assert "num_computed_tokens == 0" in computed["the victim's computed tokens restart at 0 and it waits again"]
    _, listed = failing(4, NotListed)
    assert "output.preempted.append(victim)" in listed["the plan lists the victim in output.preempted"]
    _, back = failing(4, RequeuesAtTheBack)
    assert "appendleft" in back["the victim goes to the front of the waiting queue"]
    _, blocks = failing(4, KeepsItsBlocks)
    assert "still owns 1 block: ids [" in blocks["the victim's blocks all go back to the free queue"]
    _, commit = failing(4, PlansTheCommit)
    text = commit["a rolled-back step leaves its victim as it was"]
    assert "r2: state RequestState.DECODING, num_computed_tokens 4, num_preemptions 0" in text
    assert "r2: state RequestState.WAITING, num_computed_tokens 0, num_preemptions 1" in text
    assert "preempt() only plans" in text
    text = listed["a rolled-back step leaves its victim as it was"]
    assert "got:      step 2 called preempt(output, r2), but output.preempted lists []" in text


def test_ex4_a_victim_left_out_of_output_preempted_is_named_in_every_case_not_its_double_free():
    _, messages = failing(4, NotListed)
    for text in messages.values():  # the KeyError of the next step, which preempts r2 again, is never reached
        assert "must list its victim: output.preempted.append(victim)" in text, text
        assert "raised KeyError" not in text and "whom they preempt" not in text
    assert len(messages) == len(get(4).cases)
    text = messages["the victim's preemption is counted in its metrics"]
    assert "expected: step 2's output.preempted lists [2]\n  got:      step 2 called preempt(output, r2)" in text


class InsertsVictimsFirst(Scheduler):
    """Puts each victim at the front of output.preempted: a step's victims are listed oldest first."""

    def preempt(self, output, victim):
        self.allocator.free(victim.request_id)
        output.preempted.insert(0, victim)


def test_ex4_victims_listed_in_another_order_than_preempted_are_named():
    text = only_failure(4, InsertsVictimsFirst, "two victims of one step are listed in the order they were preempted")
    assert "expected: step 2: decode r0 [4:5]; decode r1 [4:5]; preempted [3, 2]" in text
    assert "got:      step 2 preempted r3 then r2, but output.preempted lists [2, 3]" in text
    assert "output.preempted.append(victim), not insert(0, victim)" in text


class FreesAtTheCommit(Scheduler):
    """Lists the victim while planning but frees its blocks only once the step is committed."""

    def preempt(self, output, victim):
        output.preempted.append(victim)

    def requeue_preempted(self, victim):
        super().requeue_preempted(victim)
        self.allocator.free(victim.request_id)


def test_ex4_blocks_freed_too_late_are_named_by_whom_the_step_preempts():
    _, messages = failing(4, FreesAtTheCommit)
    text = messages["a preempted request's output is unchanged"]
    assert "got:      step 5: decode r0 [13:14]; preempted [3, 2, 1]" in text
    assert "preempt() frees the victim's blocks at once" in text
    blocks = messages["the victim's blocks all go back to the free queue"]  # by the end of the step they had
    assert "expected: r2 owns no blocks once preempt(output, r2) returns" in blocks
    assert "r2 still owned 1 block (ids [2]) when preempt returned" in blocks
    assert "not later in requeue_preempted()" in blocks


class ClearsItsOutput(Scheduler):
    """Forgets the victim's generated tokens, so it recomputes its prompt alone."""

    def requeue_preempted(self, victim):
        super().requeue_preempted(victim)
        victim.output_token_ids.clear()


def test_ex4_a_recomputation_is_shown_after_the_step_that_preempted():
    _, messages = failing(4, ClearsItsOutput)
    text = messages["a preempted request's output is unchanged"]
    assert "step 5: decode r0 [13:14]; decode r1 [12:13]; decode r2 [13:14]; preempted [3]" in text
    assert "got:      step 6: decode r0 [14:15]; decode r1 [13:14]; decode r2 [14:15]; prefill r3 [0:8]" in text
    assert "keep victim.output_token_ids" in text


def test_the_step_history_keeps_the_latest_steps_and_every_preemption():
    done = [f"step {i}" + ("; preempted [3]" if i == 2 else "") for i in range(1, 11)]
    assert history(done) == ["...", "step 2; preempted [3]", "...", *done[4:]]
    assert history(done[:5]) == done[:5]


class InsertsIntoTheQueue(Scheduler):
    """Treats the waiting queue as a list: a method it does not have, so the code stops before any check."""

    def requeue_preempted(self, victim):
        self.waiting.insert(0, victim)


def test_ex4_code_that_cannot_run_is_named_where_it_stops_not_by_each_cases_hint():
    _, messages = failing(4, InsertsIntoTheQueue)
    for text in messages.values():
        assert "your code raised AttributeError" in text and "self.waiting.insert(0, victim)" in text
        assert "AttributeError in your requeue_preempted() (line" in text and "fix that line" in text
    with_case = [text for text in messages.values() if "What this case checks:" in text]  # after where it stopped
    assert with_case and all(t.index("fix that line") < t.index("What this case checks:") for t in with_case)


def test_only_the_learners_own_frames_count_as_code_that_cannot_run():
    from labkit.exercises.framework import Case, run_case

    namespace: dict = {}
    exec("def broken(_):\n    return None.missing\n", namespace)  # code with no file: '<string>'
    here = Case("a case", lambda implementation: implementation(None), hint="what the case checks")
    assert run_case(here, namespace["broken"]).hint == "what the case checks"

    def own(_):
        return None.missing  # this file is outside labkit and the environment: the learner's

    hint = run_case(here, own).hint
    assert hint.startswith("AttributeError in your own() (line") and hint.endswith(
        "What this case checks: what the case checks"
    )


def test_ex4_output_case_really_preempts():
    from labkit.core.sim import SimulatedModel
    from labkit.exercises.engine_runs import config, prompts

    workload = [(10, 16), (9, 16), (11, 16), (8, 16)]
    engine = Engine(SimulatedModel(), config(num_blocks=14, max_batch_tokens=24))
    outs = engine.generate(prompts(workload), [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 4)
    assert sum(o.metrics.num_preemptions for o in outs) > 0


# ------------------------------------------------------------------ exercise 5
def reads_one_past(q, k, v, table, context_len, scale):
    return paged_attention(q, k, v, table, min(context_len + 1, len(table) * k.shape[2]), scale)[:, -q.shape[1] :]


def blocks_in_id_order(q, k, v, table, context_len, scale):
    return paged_attention(q, k, v, list(range(len(table))), context_len, scale)


def not_causal(q, k, v, table, context_len, scale):
    rows = [paged_attention(q[:, i : i + 1], k, v, table, context_len, scale) for i in range(q.shape[1])]
    return torch.cat(rows, dim=1)


def wrong_head_groups(q, k, v, table, context_len, scale):
    heads, kv = q.shape[0], k.shape[0]
    order = torch.arange(heads).view(kv, heads // kv).t().flatten()  # pairs query heads as repeat() would
    out = paged_attention(q[order], k, v, table, context_len, scale)
    return out[torch.argsort(order)]


def returns_float32(q, k, v, table, context_len, scale):
    return paged_attention(q.float(), k.float(), v.float(), table, context_len, scale)


def written_out(
    q, k, v, table, context_len, scale, *, visible=operator.le, softmax_dim=-1, on_device=True, shifted=True
):
    """paged_attention written from the contract, step by step; the planted mistakes change one step."""
    heads, queries, _ = q.shape
    block_size = k.shape[2]
    device = q.device if on_device else None  # None: torch's default device, the CPU
    blocks = torch.tensor(list(table[: blocks_for(context_len, block_size)]), device=device)
    keys = k[:, blocks].flatten(1, 2)[:, :context_len].repeat_interleave(heads // k.shape[0], 0).float()
    values = v[:, blocks].flatten(1, 2)[:, :context_len].repeat_interleave(heads // k.shape[0], 0).float()
    scores = q.float() @ keys.transpose(1, 2) * scale
    query_pos = torch.arange(context_len - queries, context_len, device=device)[:, None]
    scores = scores.masked_fill(~visible(torch.arange(context_len, device=device), query_pos), float("-inf"))
    if not shifted:  # exp of the scores as they are, as a softmax written out by hand may do
        exponentials = scores.exp()
        return (exponentials / exponentials.sum(softmax_dim, keepdim=True) @ values).to(q.dtype)
    return (scores.softmax(softmax_dim) @ values).to(q.dtype)


def sdpa_is_causal(q, k, v, table, context_len, scale):
    """F.scaled_dot_product_attention(is_causal=True): its mask is aligned to the top left, wrong when Q < K."""
    heads, block_size = q.shape[0], k.shape[2]
    blocks = torch.tensor(list(table[: blocks_for(context_len, block_size)]))
    keys, values = (
        c[:, blocks].flatten(1, 2)[:, :context_len].repeat_interleave(heads // k.shape[0], 0) for c in (k, v)
    )
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale)


def ignores_scale(q, k, v, table, context_len, scale):
    return paged_attention(q, k, v, table, context_len, q.shape[-1] ** -0.5)


def sorted_blocks(q, k, v, table, context_len, scale):
    return paged_attention(q, k, v, sorted(table), context_len, scale)


def whole_last_block(q, k, v, table, context_len, scale):
    return paged_attention(q, k, v, table, blocks_for(context_len, k.shape[2]) * k.shape[2], scale)


def every_block_in_table(q, k, v, table, context_len, scale):
    """Reads every block the table lists, as if the context ended with the table's last slot."""
    return paged_attention(q, k, v, table, len(table) * k.shape[2], scale)


def test_ex5_planted_mistakes_are_named():
    _, past = failing(5, reads_one_past)
    text = past["a decode query over a context that ends mid-block"]
    assert "reading context_len + 1 positions would give" in text and "only partly filled" not in text
    _, order = failing(5, blocks_in_id_order)
    assert "reading blocks 0, 1, 2, ... in place of the block table's" in order["blocks are read in block-table order"]
    _, causal = failing(5, not_causal)
    assert list(causal) == ["a prefill chunk attends causally", *list(causal)[1:]]
    assert "no causal mask would give" in causal["a prefill chunk attends causally"]
    _, heads = failing(5, wrong_head_groups)
    assert "repeat_interleave" in heads["grouped-query attention: query heads share KV heads"]
    _, dtype = failing(5, returns_float32)
    assert list(dtype) == ["bfloat16 tensors give a bfloat16 output close to float32 attention"]
    text = dtype["bfloat16 tensors give a bfloat16 output close to float32 attention"]
    assert "the query's dtype, torch.bfloat16" in text and "dtype torch.float32" in text and ".to(query.dtype)" in text


def test_ex5_a_softmax_that_overflows_on_large_scores_is_named():
    text = only_failure(5, functools.partial(written_out, shifted=False), "large scores: the softmax stays finite")
    assert "scale=40.0" in text and "= [nan, nan, nan, nan]" in text
    assert "Your output is what a softmax that exponentiates the scores without subtracting each row's largest" in text
    assert "scores.softmax(dim=-1) does it for you" in text


@pytest.mark.parametrize(
    ("planted", "named"),
    [
        pytest.param(ignores_scale, "scaling by 1/sqrt(D) = 0.354 in place of scale = ", id="scale"),
        pytest.param(
            functools.partial(written_out, visible=operator.lt),
            "a causal mask that hides each query's own position",
            id="mask-hides-its-own",
        ),
        pytest.param(
            functools.partial(written_out, visible=lambda key, query: key <= query + 1),
            "a causal mask one position late",
            id="mask-one-late",
        ),
        pytest.param(not_causal, "no causal mask", id="no-mask"),
        pytest.param(sdpa_is_causal, "a causal mask aligned to the top left", id="sdpa-is-causal"),
        pytest.param(wrong_head_groups, "query head h reading KV head h % KV", id="gqa-modulo"),
        pytest.param(sorted_blocks, "reading the blocks in sorted order", id="sorted-blocks"),
        pytest.param(blocks_in_id_order, "reading blocks 0, 1, 2, ...", id="blocks-by-id"),
        pytest.param(whole_last_block, "reading every slot of the last block", id="whole-last-block"),
        pytest.param(reads_one_past, "reading context_len + 1 positions", id="one-past-the-context"),
        pytest.param(functools.partial(written_out, softmax_dim=1), "a softmax over dim 1", id="softmax-dim"),
    ],
)
def test_ex5_a_systematic_mistake_is_named_first_in_every_case_it_fails(planted, named):
    result, _ = failing(5, planted)
    for failure in result.failures:  # several mistakes may give the same output on one input: each is named
        named_first = failure.hint.split(": ")[0]
        assert failure.kind == "mismatch" and named_first.startswith("Your output is what "), failure.message()
        assert named in named_first, failure.message()


def test_ex5_a_named_mistake_replaces_the_hints_of_the_cases_it_breaks():
    # Each case's own hint is about its topic (GQA, block order, ...): beside the named mistake it would read
    # as a second bug.
    _, messages = failing(5, sorted_blocks)
    text = messages["grouped-query attention: query heads share KV heads"]
    assert "reading the blocks in sorted order" in text and "repeat_interleave" not in text


def trims_the_last_block(q, k, v, table, context_len, scale):
    """Reads the whole table, less the last block's slots past the context: right only where the table ends there."""
    block_size = k.shape[2]
    unused = -context_len % block_size
    return paged_attention(q, k, v, table, len(table) * block_size - unused, scale)[:, -q.shape[1] :]


def test_ex5_a_table_read_to_its_end_fails_where_it_lists_blocks_reserved_ahead():
    text = only_failure(5, trims_the_last_block, "a block table reserved ahead lists blocks past the context")
    assert "the table's last 2 blocks are reserved ahead, past the context" in text
    assert "a static batch reserves its blocks up front" in text
    assert "read its first ceil(context_len / block_size) blocks" in text


def test_ex5_blocks_reserved_past_the_context_are_named_not_blamed_on_the_last_block():
    result, messages = failing(5, every_block_in_table)
    for failure in result.failures:  # where the table ends with the context, reading it all is the last block's
        reserved = "reserved ahead" in failure.input
        named = "reading every block of block_table" if reserved else "reading every slot of the last block"
        assert failure.hint.startswith(f"Your output is what {named}"), failure.message()
    text = messages["a block table reserved ahead lists blocks past the context"]
    assert "block_table=[3, 8, 10, 0, 1], context_len=10" in text
    assert "reading every block of block_table (len(block_table) * block_size positions" in text
    assert "read its first ceil(context_len / block_size) blocks" in text and "of the last block" not in text
    _, messages = failing(5, whole_last_block)  # reads the context's blocks only: the reserved ones are not named
    text = messages["a block table reserved ahead lists blocks past the context"]
    assert "reading every slot of the last block" in text and "every block of block_table" not in text


def keys_in_head_order(q, k, v, table, context_len, scale):
    """repeat() on the keys only: a GQA mistake no single replay gives, wrong in float32 and bfloat16 alike."""
    heads, kv = q.shape[0], k.shape[0]
    order = torch.arange(heads).view(kv, heads // kv).t().flatten()
    keys = paged_attention(q[order], k, v, table, context_len, scale)[torch.argsort(order)]
    return (keys + paged_attention(q, k, v, table, context_len, scale)) / 2


def test_ex5_a_bfloat16_failure_that_float32_shares_is_not_blamed_on_the_dtype():
    _, messages = failing(5, keys_in_head_order)
    text = messages["bfloat16 tensors give a bfloat16 output close to float32 attention"]
    assert "wrong on these inputs in float32 too" in text and "8 bits of mantissa" not in text
    _, dtype = failing(5, returns_float32)  # right in float32: the dtype hint stays
    assert ".to(query.dtype)" in dtype["bfloat16 tensors give a bfloat16 output close to float32 attention"]


def test_ex5_a_random_failure_says_how_to_reproduce_it():
    _, messages = failing(5, keys_in_head_order)  # named mistakes replace this hint: this one is none of them
    text = messages["random shapes match dense attention"]
    assert "s = scenario(num_heads=" in text and "dense_attention(s, 0.25)" in text


def test_ex5_a_mistake_that_cannot_be_replayed_is_skipped_not_blamed():
    # The context fills its blocks exactly, so "reading context_len + 1 positions" has no slot to read: its
    # replay is skipped, and the mistake replayed after it is still named.
    assert check(5, written_out, quiet=True).passed  # the implementation the mistakes are planted in
    _, messages = failing(5, functools.partial(written_out, softmax_dim=1))
    text = messages["one decode query over whole blocks"]
    assert "raised" not in text and "hint:     Your output is what a softmax over dim 1 (the queries) would" in text


def test_ex5_a_function_that_returns_no_tensor_is_told_to_return_the_output():
    _, messages = failing(5, lambda q, k, v, table, context_len, scale: None)
    assert len(messages) == len(get(5).cases)
    for text in messages.values():
        assert "got:      None" in text and "return the output tensor, (H, Q, D)" in text, text
        assert "gather the request's blocks" not in text


def output_on_the_cpu(q, k, v, table, context_len, scale):
    return paged_attention(q, k, v, table, context_len, scale).cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="meta has no data to copy to the CPU: a GPU only")
def test_ex5_an_output_copied_to_the_cpu_is_named_on_a_gpu():
    text = only_failure(5, output_on_the_cpu, "the output stays on the query's device (a GPU's, or without one, meta)")
    assert "expected: a tensor on the query's device, cuda:0" in text and "got:      a tensor on cpu" in text
    assert "query.device" in text


def test_ex5_a_tensor_made_off_the_querys_device_is_named_with_or_without_a_gpu():
    """Without a GPU the case runs on meta too, where a mask made without device= raises as on a GPU."""
    case = "the output stays on the query's device (a GPU's, or without one, meta)"
    text = only_failure(5, functools.partial(written_out, on_device=False), case)  # its mask is on the CPU
    assert "your code raised RuntimeError" in text and "device=query.device" in text
    if not torch.cuda.is_available():
        assert "query, key_cache and value_cache are on meta, torch's device with no data" in text


def test_ex5_compare_names_an_output_off_the_querys_device():
    from labkit.exercises.ex5_paged_attention import compare

    def on_the_cpu(q, k, v, table, context_len, scale):
        return torch.zeros(q.shape, dtype=q.dtype)  # torch's default device, not q.device

    with pytest.raises(framework.Mismatch) as raised:  # the meta device stands in for a GPU: shapes, no values
        compare(on_the_cpu, "", heads=2, kv_heads=1, context=6, queries=1, block_size=4, device="meta", values=False)
    assert raised.value.expected == "a tensor on the query's device, meta" and raised.value.got == "a tensor on cpu"
    assert "return the output on the query's device (query.device)" in raised.value.hint


def test_ex5_the_device_case_runs_the_function_on_a_machine_without_a_gpu_too(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    case = next(
        c for c in get(5).cases if c.name == "the output stays on the query's device (a GPU's, or without one, meta)"
    )
    assert framework.run_case(case, paged_attention) is None
    assert framework.run_case(case, load_implementation(get(5), STUBS)[0]).kind == "not started"


# ------------------------------------------------------------------ exercise 6
class TopPOneTooMany(Sampler):
    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        return super().sample_rows(logits, temperature, top_k, torch.clamp(top_p + 0.2, max=1.0), uniform)


class MultipliesTemperature(Sampler):
    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        return super().sample_rows(logits, 1 / temperature, top_k, top_p, uniform)


class TopKOffByOne(Sampler):
    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        return super().sample_rows(logits, temperature, torch.where(top_k > 0, top_k + 1, 0), top_p, uniform)


class GlobalRandom(Sampler):
    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        return super().sample_rows(logits, temperature, top_k, top_p, torch.rand(uniform.shape, dtype=uniform.dtype))


class RowByRow(Sampler):
    """sample_rows written from the contract, one row at a time; the subclasses below plant one mistake each."""

    top_p_first = False  # top-p before top-k
    renormalise = True  # top-p on the probabilities top-k left, renormalised
    by_probability = True  # the inverse CDF walks the tokens in decreasing probability
    temper_first = True  # the nucleus is taken from the tempered probabilities
    rescale = True  # the walk compares with uniform times the kept mass
    falls_to_kept = True  # a walk that falls through draws the last kept token, else the last token of all
    shifted = True  # the softmax subtracts the largest logit before exp
    strict = True  # the walk stops at the first cumulative probability above the target, not one equal to it

    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        rows = zip(logits, temperature.tolist(), top_k.tolist(), top_p.tolist(), uniform.tolist(), strict=True)
        return torch.tensor([self.sample_row(*row) for row in rows])

    def sample_row(self, logits, temperature, top_k, top_p, uniform):
        probs = (logits / temperature).softmax(-1)
        if not self.shifted:  # exp of the tempered logits as they are: exp(89) and above is inf in float32
            exponentials = (logits / temperature).exp()
            probs = exponentials / exponentials.sum()
        order = self.order(probs)
        keep = set(order)
        by_k = self.top_k_of(probs, order, top_k) if top_k > 0 else keep
        for nucleus in (True, False) if self.top_p_first else (False, True):
            nucleus_of = probs if self.temper_first else logits.softmax(-1)
            keep &= self.nucleus(nucleus_of, order, keep, top_p) if nucleus else by_k
        walk = [t for t in (order if self.by_probability else range(len(order))) if t in keep]
        target, mass = uniform * (sum(float(probs[t]) for t in walk) if self.rescale else 1.0), 0.0
        for token in walk:
            mass += float(probs[token])
            if mass > target or (mass == target and not self.strict):
                return token
        return walk[-1] if self.falls_to_kept else order[-1]

    def order(self, probs):
        return probs.sort(descending=True).indices.tolist()

    def top_k_of(self, probs, order, top_k):
        return set(order[:top_k])

    def nucleus(self, probs, order, keep, top_p):
        total = sum(float(probs[t]) for t in keep) if self.renormalise else 1.0
        kept, before = set(), 0.0
        for token in (t for t in order if t in keep):
            if before < top_p:
                kept.add(token)
            before += float(probs[token]) / total
        return kept


class TopPBeforeTopK(RowByRow):
    top_p_first = True


class TopPNotRenormalised(RowByRow):
    renormalise = False


class CdfInVocabularyOrder(RowByRow):
    by_probability = False


class TemperatureAfterTopP(RowByRow):
    temper_first = False


class FirstRowsTemperature(Sampler):
    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        return super().sample_rows(logits, temperature[:1].expand_as(temperature), top_k, top_p, uniform)


class FirstRowsFilters(Sampler):
    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        return super().sample_rows(logits, temperature, top_k[:1].expand_as(top_k), top_p[:1].expand_as(top_p), uniform)


class TiesHighestIdFirst(RowByRow):
    """Walks equal probabilities from the highest token id down: any order of a tie draws each token as often."""

    def order(self, probs):
        return sorted(range(len(probs)), key=lambda token: (-float(probs[token]), -token))


class TopKByTorchTopk(RowByRow):
    """torch.topk, which raises for a k beyond the vocabulary (the engine clamps top_k before sample_rows)."""

    def top_k_of(self, probs, order, top_k):
        return set(torch.topk(probs, top_k).indices.tolist())


class TopKKeepsTies(RowByRow):
    """Keeps every token at least as likely as the k-th (a threshold), so a tie at the k-th keeps more than k."""

    def top_k_of(self, probs, order, top_k):
        return {t for t in order if probs[t] >= probs[order[top_k - 1]]}


def test_ex6_a_sampler_written_from_the_contract_passes():
    assert check(6, RowByRow, quiet=True).passed
    assert check(6, TiesHighestIdFirst, quiet=True).passed
    assert check(6, TopKByTorchTopk, quiet=True).passed


def test_ex6_planted_mistakes_are_named():
    _, top_p = failing(6, TopPOneTooMany)
    assert "drew token(s) [2], which the filters remove" in top_p["top_p keeps the smallest nucleus that reaches top_p"]
    _, temperature = failing(6, MultipliesTemperature)
    assert "divide the logits by the temperature" in temperature["temperature below 1 sharpens the distribution"]
    _, top_k = failing(6, TopKOffByOne)
    assert "drew token(s) [2]" in top_k["top_k keeps the k most likely tokens"]
    _, rng = failing(6, GlobalRandom)
    assert "no torch.multinomial or torch.rand" in rng["a row draws the same token alone and in a batch"]
    for planted in (TopPBeforeTopK, TopPNotRenormalised):
        _, order = failing(6, planted)
        text = order["top_k, then top_p on the renormalised rest"]
        assert "shares {0: 1.0}" in text and "drew token(s) [1], which the filters remove" in text
    _, vocabulary = failing(6, CdfInVocabularyOrder)
    text = vocabulary["the inverse CDF walks the tokens in decreasing probability"]
    assert "expected: uniform [0, 0.4) -> 1, [0.4, 0.7) -> 3" in text and "got:      uniform [0, 0.1) -> 0" in text
    assert "not in vocabulary order" in text
    assert "walk the kept tokens in decreasing probability" in vocabulary["random rows draw like labkit's sampler"]


class TopPKeepsTheTie(RowByRow):
    """Drops a token only once the mass before it exceeds top_p (> where the contract says >=)."""

    def nucleus(self, probs, order, keep, top_p):
        total = sum(float(probs[t]) for t in keep)
        kept, before = set(), 0.0
        for token in (t for t in order if t in keep):
            if before <= top_p:
                kept.add(token)
            before += float(probs[token]) / total
        return kept


def test_ex6_temperature_after_top_p_is_named():
    text = only_failure(
        6, TemperatureAfterTopP, "temperature comes first: the nucleus is taken from the tempered probabilities"
    )
    assert "expected: tokens drawn with shares {0: 0.43, 1: 0.335, 2: 0.235}" in text
    assert "It never drew token(s) [2]" in text and "whose nucleus for top_p=0.75 is three tokens" in text


def test_ex6_one_rows_parameters_for_every_row_is_named():
    text = only_failure(6, FirstRowsTemperature, "each row of a batch uses its own temperature, top_k and top_p")
    assert "rows with (0.5, 0, 1.0)" in text and "use row i's values for row i" in text
    _, messages = failing(6, FirstRowsFilters)  # right alone, wrong in a batch: the rows' values, not randomness
    assert "use row i's values for row i" in messages["a row draws the same token alone and in a batch"]


class UniformNotRescaled(RowByRow):
    """Walks the kept tokens against the uniform alone: a uniform above the kept mass falls to the last one."""

    rescale = False


def test_ex6_a_draw_against_the_uniform_alone_is_named():
    _, messages = failing(6, UniformNotRescaled)
    tie = messages["a nucleus whose mass equals top_p exactly keeps no further token"]
    assert "expected: 2 of the 4 tokens drawn, shares [0.5, 0.5]" in tie and "got:      2 of the 4" in tie
    top_k = messages["top_k keeps the k most likely tokens"]
    for text in (tie, top_k):
        assert "the filters keep the right tokens" in text and "uniform times the kept mass" in text
        assert ">= top_p, not >" not in text and "keep the top_k most likely" not in text
    assert "temperature 1 draws each token with its softmax probability" not in messages  # nothing is cut there


class UniformNotRescaledPastTheCut(UniformNotRescaled):
    """Walks the kept tokens against the uniform alone, and a uniform above the kept mass draws the least likely
    token of all, as a walk clamped to the vocabulary's last index does: one the filters removed."""

    falls_to_kept = False


def test_ex6_a_draw_against_the_uniform_alone_that_falls_past_the_kept_tokens_is_not_blamed_on_the_filters():
    _, messages = failing(6, UniformNotRescaledPastTheCut)
    text = messages["top_p keeps the smallest nucleus that reaches top_p"]
    assert "expected: tokens drawn with shares {0: 0.625, 1: 0.375}" in text
    assert "for every uniform above the kept mass, 0.8, your sampler drew token 3, which the filters remove" in text
    text = messages["top_k keeps the k most likely tokens"]  # the kept mass before renormalising: 0.4 + 0.3
    assert "above the kept mass, 0.7, your sampler drew token 0, which the filters remove: that is what a walk" in text
    tie = messages["a nucleus whose mass equals top_p exactly keeps no further token"]
    assert "for every uniform above the kept mass, 0.5, your sampler drew token 3" in tie
    for text in messages.values():
        assert "keep the smallest prefix" not in text and ">= top_p, not >" not in text, text


class SoftmaxWithoutShift(RowByRow):
    shifted = False


def test_ex6_a_softmax_that_overflows_on_large_logits_is_named():
    text = only_failure(6, SoftmaxWithoutShift, "large logits: the softmax stays finite")
    assert "logits = [25.0, 24.9, 0.0]" in text and "logits / temperature = [100.0, 99.6, 0.0]" in text
    assert "expected: tokens drawn with shares {0: 0.598, 1: 0.403}" in text
    assert "exp(100) overflows float32 to inf" in text and "Subtract each row's largest logit before exp" in text


def test_ex6_a_sampler_wrong_on_large_logits_for_another_reason_is_not_told_they_overflow():
    _, messages = failing(6, MultipliesTemperature)
    text = messages["large logits: the softmax stays finite"]
    assert "even with these logits shifted to a largest of 0 ([0.0, -0.1, -25.0]" in text
    assert "overflows" not in text


def test_ex6_top_k_keeping_a_tie_is_named():
    text = only_failure(6, TopKKeepsTies, "top_k keeps exactly k tokens, even among equal ones")
    assert "expected: 2 of the 4 tokens drawn, shares [0.333, 0.667]" in text
    assert "got:      4 of the 4 tokens drawn, shares [0.2, 0.2, 0.2, 0.4]" in text
    assert "keep exactly top_k tokens, by rank" in text


def test_ex6_top_p_at_an_exact_tie_is_named():
    text = only_failure(6, TopPKeepsTheTie, "a nucleus whose mass equals top_p exactly keeps no further token")
    assert "expected: 2 of the 4 tokens drawn, shares [0.5, 0.5]" in text
    assert "got:      3 of the 4 tokens drawn" in text
    assert "mass before the third token is exactly 0.5" in text and ">= top_p, not >" in text


class TopKOneTooFew(RowByRow):
    """Keeps top_k - 1 tokens."""

    def top_k_of(self, probs, order, top_k):
        return set(order[: max(1, top_k - 1)])


class TopPWithoutTheCrossingToken(RowByRow):
    """Keeps only the tokens whose mass up to and including them stays within top_p (at least the first)."""

    def nucleus(self, probs, order, keep, top_p):
        total = sum(float(probs[t]) for t in keep)
        kept, mass = set(), 0.0
        for token in (t for t in order if t in keep):
            mass += float(probs[token]) / total
            if mass <= top_p or not kept:
                kept.add(token)
        return kept


def test_ex6_a_step_already_wrong_alone_is_named_before_the_order_of_steps():
    _, messages = failing(6, TopPWithoutTheCrossingToken)
    text = messages["temperature comes first: the nucleus is taken from the tempered probabilities"]
    assert '"top_p keeps the smallest nucleus that reaches top_p" checks that step alone' in text
    rows = messages["each row of a batch uses its own temperature, top_k and top_p"]
    assert "even in a batch of their own" in rows and "use row i's values for row i" not in rows
    _, messages = failing(6, TopKOffByOne)
    text = messages["top_k, then top_p on the renormalised rest"]
    assert '"top_k keeps the k most likely tokens" checks that step alone' in text
    text = only_failure(6, FirstRowsTemperature, "each row of a batch uses its own temperature, top_k and top_p")
    assert "use row i's values for row i" in text  # a mix-up of rows keeps its own hint


def test_ex6_a_filter_that_keeps_too_few_is_not_told_it_keeps_too_many():
    _, messages = failing(6, TopKOneTooFew)
    text = messages["top_k keeps exactly k tokens, even among equal ones"]
    assert "keeps fewer than top_k tokens" in text and "not every token at least as likely" not in text


def test_ex6_a_sampler_on_a_shared_generator_is_named_in_every_case():
    _, messages = failing(6, GlobalRandom)
    for name in (
        "temperature 1 draws each token with its softmax probability",
        "random rows draw like labkit's sampler",
    ):
        assert "on a second call" in messages[name] or "answers the same input differently" in messages[name]
        assert "shared random generator" in messages[name]
    assert "the filters keep the right tokens" not in "".join(messages.values())


class TopPInVocabularyOrder(RowByRow):
    """Takes the top_p cut's cumulative mass in vocabulary order; the walk is in decreasing probability."""

    def nucleus(self, probs, order, keep, top_p):
        return super().nucleus(probs, range(len(order)), keep, top_p)


class TopPMaskBeforeSorting(Sampler):
    """Masks the nucleus on the unsorted probabilities (cumsum in vocabulary order), then sorts to walk."""

    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        logits = logits / temperature[:, None]
        rank = logits.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        logits = logits.masked_fill((top_k[:, None] > 0) & (rank >= top_k[:, None]), float("-inf"))
        probs = logits.softmax(dim=-1)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
        probs, ids = probs.sort(dim=-1, descending=True, stable=True)
        cdf = probs.double().cumsum(dim=-1)
        index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=probs.shape[-1] - 1)
        return ids.gather(1, index).squeeze(1)


@pytest.mark.parametrize("planted", [TopPInVocabularyOrder, TopPMaskBeforeSorting])
def test_ex6_a_top_p_cut_in_vocabulary_order_is_told_to_sort_by_probability_first(planted):
    _, messages = failing(6, planted)
    assert list(messages) == [
        "top_p keeps the most likely tokens, wherever they sit in the vocabulary",
        "random rows draw like labkit's sampler",
    ]
    text = messages["top_p keeps the most likely tokens, wherever they sit in the vocabulary"]
    assert "your sampler drew token(s) [0], which the filters remove" in text
    assert "take top_p's cumulative mass in decreasing probability, not in vocabulary order" in text


class CdfNotStrict(RowByRow):
    """Takes the first token whose cumulative probability reaches the target (>= where the contract says >)."""

    strict = False


class SearchsortedNotRight(Sampler):
    """labkit's steps, with torch.searchsorted's default right=False: the first cdf >= target."""

    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        probs, ids = (logits / temperature[:, None]).softmax(-1).sort(dim=-1, descending=True, stable=True)
        cdf = probs.double().cumsum(dim=-1)
        index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).clamp_(max=probs.shape[-1] - 1)
        return ids.gather(1, index).squeeze(1)


def test_ex6_an_inverse_cdf_that_is_not_strict_is_named_at_an_exact_boundary():
    text = only_failure(6, CdfNotStrict, "a cumulative probability equal to the target draws the next token")
    assert "uniform = each of [0.0, 0.125, 0.25" in text
    assert "expected: uniform [0, 0.25) -> 0, [0.25, 0.5) -> 1, [0.5, 0.75) -> 2, [0.75, 1) -> 3" in text
    assert "got:      uniform [0, 0.375) -> 0" in text
    assert "exceeds uniform times the kept mass, strictly (torch.searchsorted needs right=True)" in text
    assert "cdf > target, not cdf >= target" in text
    _, messages = failing(6, SearchsortedNotRight)  # no filters: fails where they cut, and at the exact boundary
    text = messages["a cumulative probability equal to the target draws the next token"]
    assert "strictly (torch.searchsorted needs right=True)" in text


class RankMadeOnTheCpu(Sampler):
    """labkit's steps, vectorised, with the top-k rank made by torch.arange(vocab) without device=: right on the
    CPU, where everything is, but on a GPU the rank is on the CPU and the logits are not."""

    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        vocab = logits.shape[-1]
        sorted_logits, ids = (logits / temperature[:, None]).sort(dim=-1, descending=True, stable=True)
        beyond_k = torch.arange(vocab) >= torch.where(top_k > 0, top_k, vocab)[:, None]
        probs = sorted_logits.masked_fill(beyond_k, float("-inf")).softmax(dim=-1)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
        cdf = probs.double().cumsum(dim=-1)
        index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
        return ids.gather(1, index).squeeze(1)


def test_ex6_a_tensor_made_without_the_logits_device_is_named():
    """Without a GPU the case runs on meta, where the CPU rank cannot mix with the rows, as on a GPU it cannot."""
    name = "rows on a GPU (or, without one, on meta) mix no devices"
    text = only_failure(6, RankMadeOnTheCpu, name)
    device = "cuda" if torch.cuda.is_available() else "meta"
    assert f"every tensor on {device}" in text and "your code raised RuntimeError" in text
    assert "beyond_k = torch.arange(vocab)" in text  # the line where the CPU tensor meets the rows
    assert "make every tensor you create on logits.device: torch.arange(vocab, device=logits.device)" in text


class CdfByMatmulOnTheCpu(Sampler):
    """Right on the CPU; the CDF is a matmul with a triangle of ones made without device= (meta lets that through
    on its own: on a GPU it raises)."""

    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        vocab = logits.shape[-1]
        sorted_logits, ids = (logits / temperature[:, None]).sort(dim=-1, descending=True, stable=True)
        beyond_k = torch.arange(vocab, device=logits.device) >= torch.where(top_k > 0, top_k, vocab)[:, None]
        probs = sorted_logits.masked_fill(beyond_k, float("-inf")).softmax(dim=-1)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0).double()
        cdf = probs @ torch.ones(vocab, vocab, dtype=torch.float64).triu()
        index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
        return ids.gather(1, index).squeeze(1)


class GatherIndexOnTheCpu(Sampler):
    """Right on the CPU; the rows' largest logit is gathered with an index made without device=."""

    def sample_rows(self, logits, temperature, top_k, top_p, uniform):
        vocab = logits.shape[-1]
        sorted_logits, ids = (logits / temperature[:, None]).sort(dim=-1, descending=True, stable=True)
        sorted_logits = sorted_logits - sorted_logits.gather(1, torch.zeros(len(logits), 1, dtype=torch.long))
        beyond_k = torch.arange(vocab, device=logits.device) >= torch.where(top_k > 0, top_k, vocab)[:, None]
        probs = sorted_logits.masked_fill(beyond_k, float("-inf")).softmax(dim=-1)
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
        cdf = probs.double().cumsum(dim=-1)
        index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
        return ids.gather(1, index).squeeze(1)


@pytest.mark.parametrize(
    ("sampler", "line"), [(CdfByMatmulOnTheCpu, "cdf = probs @"), (GatherIndexOnTheCpu, "gather(1, torch.zeros")]
)
def test_ex6_a_cpu_tensor_in_a_matmul_or_a_gather_is_named_too(sampler, line):
    text = only_failure(6, sampler, "rows on a GPU (or, without one, on meta) mix no devices")
    assert "your code raised RuntimeError" in text and line in text
    assert "Expected all tensors to be on the same device" in text
    assert "make every tensor you create on logits.device" in text


def test_the_meta_device_check_lets_through_what_a_gpu_takes():
    """CPU indices, 0-d CPU scalars, copies and *_as ops cross devices on a GPU too; a host read ends the check."""
    from labkit.exercises.meta_device import run_on_meta

    def fine():
        rows = torch.empty(4, 8, device="meta")
        rows = rows[torch.arange(2)] * torch.tensor(2.0)
        rows[torch.tensor([0])] = 1.0
        rows[torch.tensor([1])] = torch.tensor(2.0)
        rows = rows.masked_fill(rows > 0, torch.tensor(0.0))  # meta itself refuses a CPU scalar here; CUDA takes it
        return rows.expand_as(torch.empty(2, 8)) + torch.empty(2, 8).to("meta")

    assert run_on_meta(fine).shape == (2, 8)
    assert run_on_meta(lambda: torch.empty(3, device="meta").sum().item()) is None
    meta = torch.empty(2, 3, device="meta")
    on_a_gpu_these_raise = {
        "matmul": lambda: meta @ torch.ones(3, 2),
        "searchsorted": lambda: torch.searchsorted(meta, torch.zeros(2, 1)),
        "a CPU tensor indexed on the device": lambda: torch.arange(5)[torch.zeros(2, dtype=torch.long, device="meta")],
        "CPU values written in": lambda: meta.__setitem__(torch.tensor([0]), torch.zeros(1, 3)),
        "CPU values put in": lambda: meta.index_put_((torch.tensor([0]),), torch.zeros(1, 3)),
    }
    for what, call in on_a_gpu_these_raise.items():
        with pytest.raises(RuntimeError, match="meta and cpu"):
            run_on_meta(call)
            pytest.fail(what)


def test_the_first_meta_check_imports_with_a_ctrl_c_held(monkeypatch):
    """The first op on meta imports much of torch: a Ctrl-C landing there left it half-imported, failing every later
    check in the kernel. The warm-up holds it, and delivers it once the import is whole."""
    from labkit.exercises import meta_device

    def slow_import():
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while the warm-up runs
        time.sleep(0.05)

    monkeypatch.setattr(meta_device.torch, "where", lambda *args, real=torch.where: slow_import() or real(*args))
    with pytest.raises(KeyboardInterrupt):
        meta_device.run_on_meta(lambda: pytest.fail("the learner's code ran before the held Ctrl-C was delivered"))


@pytest.mark.parametrize(
    ("returns", "says"),
    [
        (lambda tokens: tokens.tolist(), "a list: ["),
        (lambda tokens: None, "None: None"),
        (lambda tokens: tokens[:, None], "a tensor of shape ("),
    ],
    ids=["list", "None", "column"],
)
def test_ex6_a_sampler_that_returns_no_tensor_of_token_ids_is_told_what_to_return(returns, says):
    class Returns(Sampler):
        def sample_rows(self, logits, temperature, top_k, top_p, uniform):
            return returns(super().sample_rows(logits, temperature, top_k, top_p, uniform))

    _, messages = failing(6, Returns)
    assert len(messages) == len(get(6).cases)
    for text in messages.values():
        assert "a (" in text and ",) tensor of token ids, one per row" in text and f"got:      {says}" in text, text
        assert "return a (rows,) tensor of token ids, not" in text and "your code raised" not in text
    if says.startswith("a list"):
        assert "not a list (torch.tensor(...) makes one)" in text


def test_a_property_case_whose_implementation_answers_differently_is_named_not_a_hypothesis_error():
    from hypothesis import strategies as st

    calls = []

    def test(implementation, example):
        framework.showing(f"example={example}")
        calls.append(example)
        if len(calls) == 1:
            raise framework.Mismatch(f"example={example}", "1", "2", "")

    case = framework.property_case("flaky", lambda: st.integers(0, 3), test)
    failure = framework.run_case(case, None)
    assert failure.kind == "mismatch" and "Flaky" not in failure.got
    assert "answers the same input differently" in failure.hint


# ------------------------------------------------------------------ exercise 7
class LearnerStatic(Scheduler):
    """form_static_batch written from the contract; the subclasses below plant one mistake each."""

    def fits(self, batch, request):
        longest = max([r.num_prompt_tokens for r in batch] + [request.num_prompt_tokens])
        return not batch or (len(batch) + 1) * longest <= self.config.max_batch_tokens

    def reserve(self, request):
        return request.num_prompt_tokens + request.params.max_new_tokens - 1

    def form_static_batch(self, output):
        for request in self.waiting:
            if len(output.admitted) >= self.config.max_num_seqs:
                break
            fits = self.fits(output.admitted, request)
            if fits and self.allocator.can_allocate(request.request_id, self.reserve(request)):
                self.allocator.allocate(request.request_id, self.reserve(request))
                output.admitted.append(request)
            elif not self.skip_ahead:
                break
        return output.admitted

    skip_ahead = False


class SumsPrompts(LearnerStatic):
    """Counts the batch's prompt tokens instead of its padded rows."""

    def fits(self, batch, request):
        return sum(r.num_prompt_tokens for r in [*batch, request]) <= self.config.max_batch_tokens


class ReservesThePromptOnly(LearnerStatic):
    def reserve(self, request):
        return request.num_prompt_tokens


class SkipsAhead(LearnerStatic):
    skip_ahead = True


class SkipsPastBlocks(LearnerStatic):
    """Passes a request whose blocks cannot be reserved for a later one (the padding rule still ends the batch)."""

    def form_static_batch(self, output):
        for request in self.waiting:
            if len(output.admitted) >= self.config.max_num_seqs or not self.fits(output.admitted, request):
                break
            if self.allocator.can_allocate(request.request_id, self.reserve(request)):
                self.allocator.allocate(request.request_id, self.reserve(request))
                output.admitted.append(request)
        return output.admitted


class NoBatchOfOne(LearnerStatic):
    """Applies the padding rule to the first member too: a prompt longer than the budget never starts."""

    def fits(self, batch, request):
        longest = max([r.num_prompt_tokens for r in batch] + [request.num_prompt_tokens])
        return (len(batch) + 1) * longest <= self.config.max_batch_tokens


class RefusesAnExactFit(LearnerStatic):
    """Ends the batch when its padded rows would come to max_batch_tokens exactly (>= where the contract says >)."""

    def fits(self, batch, request):
        longest = max([r.num_prompt_tokens for r in batch] + [request.num_prompt_tokens])
        return not batch or (len(batch) + 1) * longest < self.config.max_batch_tokens


class ReservesTheLastToken(LearnerStatic):
    def reserve(self, request):
        return request.num_prompt_tokens + request.params.max_new_tokens


class NeverAllocates(LearnerStatic):
    def reserve(self, request):
        return 0


def test_ex7_a_policy_written_from_the_contract_passes():
    assert check(7, LearnerStatic, quiet=True).passed


class ForgetsToReturnTheBatch(LearnerStatic):
    def form_static_batch(self, output):
        super().form_static_batch(output)


def test_ex7_a_batch_that_is_not_returned_is_named():
    _, messages = failing(7, ForgetsToReturnTheBatch)
    assert len(messages) == len(get(7).cases)
    for text in messages.values():
        assert "got:      step 1: form_static_batch returned None" in text, text
        assert "return output.admitted" in text


def test_ex7_planted_mistakes_are_named():
    _, padded = failing(7, SumsPrompts)
    assert (
        "padded to 10 tokens = 40 rows, but max_batch_tokens is 24"
        in padded["a batch's padded prompt rows fit max_batch_tokens"]
    )
    _, reserve = failing(7, ReservesThePromptOnly)
    text = reserve["each member reserves its prompt and every token it may generate"]
    assert "r0 was admitted with 8 slots reserved; it may need 13" in text
    assert "reserve each member's whole future up front" in text
    # Reserving too little admits more members than fit: that step is blamed on the reservation, not on the order.
    text = reserve["the first request whose blocks cannot be reserved ends the batch"]
    assert "reserve each member's whole future up front" in text and "never skip ahead" not in text
    _, skip = failing(7, SkipsAhead)
    assert "step 1: prefill r0 [0:4]; admitted [0]" in skip["the first request that does not fit ends the batch"]
    text = only_failure(7, SkipsPastBlocks, "the first request whose blocks cannot be reserved ends the batch")
    assert "expected: step 1: prefill r0 [0:8]; admitted [0]" in text and "admitted [0, 2]" in text
    assert "whether its padded rows or its blocks" in text
    _, alone = failing(7, NoBatchOfOne)
    assert list(alone) == ["a first prompt longer than max_batch_tokens forms a batch of its own"]
    text = alone["a first prompt longer than max_batch_tokens forms a batch of its own"]
    assert "step 1: prefill r0 [0:16]; admitted [0]" in text and "the first request always joins" in text
    _, last = failing(7, ReservesTheLastToken)
    assert list(last) == ["the last generated token needs no slot"]
    text = last["the last generated token needs no slot"]
    assert "admitted [0, 1, 2]" in text and "admitted [0, 1]" in text and "never fed back" in text
    _, exact = failing(7, RefusesAnExactFit)
    text = exact["a batch whose padded rows are exactly max_batch_tokens fits"]
    assert "expected: step 1: prefill r0 [0:6]; prefill r1 [0:6]; admitted [0, 1]" in text
    assert "got:      step 1: prefill r0 [0:6]; admitted [0]" in text and "(>, not >=)" in text
    _, unallocated = failing(7, NeverAllocates)
    text = unallocated["random workloads form the batches labkit forms"]
    assert "step 1 schedules r0 [0:1], but r0's blocks hold 0 tokens" in text and "raised" not in text


# ------------------------------------------------------------------ exercise 8: planted mistakes
class BigEndianHash(PrefixCache):
    """Packs the token ids big-endian: a digest no other engine (or trace) agrees with."""

    packing = ">{}q"  # struct's format for n token ids

    @classmethod
    def block_hash(cls, parent, token_ids):
        digest = hashlib.sha256(parent or b"")
        digest.update(struct.pack(cls.packing.format(len(token_ids)), *token_ids))
        return digest.digest()


class FourByteTokens(BigEndianHash):
    """Packs each token id in 4 bytes ('i'), not 8 ('q'): every digest differs, a first block's too."""

    packing = "<{}i"


class UnchainedHash(PrefixCache):
    """Hashes a block's own tokens only: the same tokens after another prefix collide."""

    @staticmethod
    def block_hash(parent, token_ids):
        return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def _lookup(cache, request, *, serve_last=False, confirm=True, stop=True, as_tuple=True, first_n=True):
    """labkit's match with one rule broken, for the planted mistakes below."""
    size = cache.block_size
    num_query = (request.num_tokens - (0 if serve_last else 1)) // size
    if num_query == 0:
        return PrefixMatch([], request.num_tokens, 0, "short")
    digests, blocks, miss = cache.hashes(request, num_query), [], None
    for index, digest in enumerate(digests[:num_query] if first_n else digests):
        entry = cache.index.get(digest)
        tokens = request.tokens(index * size, (index + 1) * size)
        tokens = tuple(tokens) if as_tuple else tokens
        stale = entry is not None and entry.block_id in cache.stale
        if entry is None or stale or (confirm and entry.token_ids != tokens):
            miss = miss or ("evicted" if stale or digest in cache.evicted else "new")
            if stop:
                break
            continue
        blocks.append(entry.block_id)
    return PrefixMatch(blocks, request.num_tokens, num_query, miss)


class ServesTheLastToken(PrefixCache):
    def match(self, request):
        return _lookup(self, request, serve_last=True)


class WalksEveryDigest(PrefixCache):
    """Walks every digest hashes() returns, which may be more than the blocks that could be served."""

    def match(self, request):
        return _lookup(self, request, first_n=False)


class TrustsTheDigest(PrefixCache):
    def match(self, request):
        return _lookup(self, request, confirm=False)


class SkipsAMiss(PrefixCache):
    def match(self, request):
        return _lookup(self, request, stop=False)


class EveryMissIsNew(PrefixCache):
    def match(self, request):
        found = PrefixCache.match(self, request)
        return found._replace(miss="new") if found.miss == "evicted" else found


class TupleBlocks(PrefixCache):
    def match(self, request):
        found = PrefixCache.match(self, request)
        return found._replace(blocks=tuple(found.blocks))


class NoBlocksIsNone(PrefixCache):
    def match(self, request):
        found = PrefixCache.match(self, request)
        return found if found.blocks else found._replace(blocks=None)


class IgnoresTheParent(PrefixCache):
    """Confirms a hit against the entry's token ids only, not its parent digest."""

    def match(self, request):
        return _lookup(self, request)


class ComparesAListWithATuple(PrefixCache):
    def match(self, request):
        return _lookup(self, request, as_tuple=False)


def test_ex8_a_list_compared_with_the_entrys_tuple_is_named():
    _, messages = failing(8, ComparesAListWithATuple)
    text = messages["match returns the cached blocks of the longest cached prefix"]
    assert "blocks=[], " in text and "miss='new'" in text
    assert "request.tokens(start, end) is a list and entry.token_ids a tuple" in text


def test_ex8_blocks_may_be_any_sequence_and_a_wrong_one_shows_itself():
    assert check(8, TupleBlocks, quiet=True).passed  # the allocator takes any sequence of block ids
    _, messages = failing(8, NoBlocksIsNone)
    text = messages["match never serves a request's last token"]
    assert "expected: PrefixMatch(blocks=[]," in text and "got:      PrefixMatch(blocks=None," in text


def test_ex8_planted_mistakes_are_named():
    _, messages = failing(8, BigEndianHash)
    assert "block_hash is SHA-256 over the tokens as little-endian 8-byte ints" in messages
    assert "'<' is little-endian" in messages["block_hash is SHA-256 over the tokens as little-endian 8-byte ints"]
    _, messages = failing(8, UnchainedHash)
    assert set(messages) == {"block_hash chains each block to its parent's digest"}
    assert "hash the parent block's digest first" in messages["block_hash chains each block to its parent's digest"]
    _, messages = failing(8, ServesTheLastToken)
    text = messages["match never serves a request's last token"]
    assert "num_query_blocks=2" in text and "num_query_blocks=3" in text and "logits to sample" in text
    _, messages = failing(8, WalksEveryDigest)  # _lookup never confirms the parent: that case fails too
    text = messages["match never serves a request's last token"]
    assert "all its full blocks hashed already" in text and "blocks=[0, 1, 2]" in text and "walk the first n" in text
    _, messages = failing(8, TrustsTheDigest)
    assert "a digest can collide" in messages["a hit is confirmed against the token ids"]
    _, messages = failing(8, SkipsAMiss)
    assert "return at the first miss" in messages["match stops at the first block that misses"]
    _, messages = failing(8, EveryMissIsNew)
    assert "miss='evicted'" in messages["a miss says why: short, evicted or new"]


def test_ex8_a_first_block_packed_otherwise_is_blamed_on_the_packing_not_on_the_chaining():
    _, messages = failing(8, FourByteTokens)
    text = messages["block_hash chains each block to its parent's digest"]
    assert "input:    block_hash(None, [1, 2, 3, 4])\n" in text
    assert "the digest of a first block, which has no parent (None), already differs" in text
    assert "'q' an 8-byte int" in text and "hash the parent block's digest first" not in text


def test_ex8_a_hit_confirmed_without_its_parent_is_named():
    name = "a hit is confirmed against the parent digest: the same tokens after another prefix miss"
    text = only_failure(8, IgnoresTheParent, name)
    assert "block 63 holds [14, 15, 16, 17] after [1, 2, 3, 4]" in text
    assert "expected: PrefixMatch(blocks=[0], num_query_tokens=13, num_query_blocks=3, miss='new')" in text
    assert "got:      PrefixMatch(blocks=[0, 63, 2]," in text
    assert "depend on every token before it" in text and "entry.parent" in text


def test_ex8_a_collision_handed_out_in_another_case_is_named_as_one():
    _, messages = failing(8, TrustsTheDigest)
    text = messages["match stops at the first block that misses"]
    assert "got:      PrefixMatch(blocks=[63, 1, 2]" in text and "block 63, the planted collision" in text
    assert "return at the first miss" not in text


def test_ex8_serving_the_last_token_in_the_engine_is_not_blamed_on_the_scheduler():
    _, messages = failing(8, ServesTheLastToken)
    text = messages["inside the engine, a shared system prompt is served as with labkit's cache"]
    assert "a chunk of 0 tokens" in text and "your match served every token" in text
    assert "budget is positive" not in text


class TouchesTheLruOrder(PrefixCache):
    """Moves every hit to the most recently used end in match: nothing undoes it, and eviction changes."""

    def match(self, request):
        found = PrefixCache.match(self, request)
        for block in found.blocks:
            if block in self.reusable:
                self.reusable.move_to_end(block)
        return found


class DropsAStaleEntry(PrefixCache):
    """Deletes a stale block's index entry in match, leaving digest_of naming it: a later eviction raises."""

    def match(self, request):
        found = PrefixCache.match(self, request)
        digests = self.hashes(request, found.num_query_blocks)
        if found.miss == "evicted" and len(found.blocks) < len(digests):
            entry = self.index.get(digests[len(found.blocks)])
            if entry is not None and entry.block_id in self.stale:
                del self.index[digests[len(found.blocks)]]
        return found


class LooksUpThePromptOnly(PrefixCache):
    """Counts the prompt's tokens only: a preempted request, readmitted, misses the blocks of what it generated."""

    def match(self, request):
        prompt_only = type(request)(request.request_id, request.prompt_token_ids, request.params)
        found = PrefixCache.match(self, prompt_only)
        return found._replace(num_query_tokens=request.num_tokens)


class BytearrayDigests(PrefixCache):
    @staticmethod
    def block_hash(parent, token_ids):
        return bytearray(prefix_cache.block_hash(parent, token_ids))


class MissNewWhenAllHit(PrefixCache):
    def match(self, request):
        found = PrefixCache.match(self, request)
        return found if found.miss is not None or not found.num_query_blocks else found._replace(miss="new")


def test_ex8_a_match_that_changes_the_cache_is_named():
    name = "a lookup leaves the cache as it was: the eviction order, the index"
    for mistake, changed in ((TouchesTheLruOrder, "cache.reusable (the LRU order): [2, 1, 0, 4] -> [4, 0, 1, 2]"),
                             (DropsAStaleEntry, "cache.index: 3 entries -> 2 entries")):  # fmt: skip
        _, messages = failing(8, mistake)
        text = messages[name]
        assert "expected: the cache as it was before the lookup" in text and f"got:      {changed}" in text, text
        assert "match only looks" in text and "changes which block is evicted next" in text


def test_ex8_a_lookup_of_the_prompt_alone_misses_a_readmitted_requests_own_blocks():
    _, messages = failing(8, LooksUpThePromptOnly)
    text = messages["a readmitted request's own generated tokens are looked up too"]
    assert "request with prompt [10, 11, 12, 13, 14, 15] and 7 tokens it generated" in text
    assert "expected: PrefixMatch(blocks=[0, 1, 2], num_query_tokens=13, num_query_blocks=3, miss=None)" in text
    assert "got:      PrefixMatch(blocks=[0], num_query_tokens=13, num_query_blocks=1, miss=None)" in text
    assert "count request.num_tokens" in text
    engine = messages["inside the engine, preempted requests find the blocks they computed, as with labkit's cache"]
    assert "preempted [" in engine and "hit blocks [0, 1, 5]" in engine and "request.tokens(start, end)" in engine


def test_ex8_a_digest_that_is_not_bytes_is_named():
    text = failing(8, BytearrayDigests)[1]["block_hash is SHA-256 over the tokens as little-endian 8-byte ints"]
    assert "(not bytes)" in text and "return bytes, as hashlib's .digest() gives them" in text


class IndexedWithBrackets(PrefixCache):
    """self.index[digest] where a miss is possible: a KeyError, raised by the learner's own line."""

    def match(self, request):
        for digest in self.hashes(request, (request.num_tokens - 1) // self.block_size):
            self.index[digest]  # the lookup that raises
        return PrefixCache.match(self, request)


def test_ex8_an_error_is_shown_where_it_was_raised_with_a_hint_in_every_case():
    _, messages = failing(8, BytearrayDigests)
    text = messages["match returns the cached blocks of the longest cached prefix"]
    assert "TypeError: unhashable type: 'bytearray'" in text
    assert "not in your code: labkit's insert() (prefix_cache.py) raised it" in text
    text = failing(8, IndexedWithBrackets)[1]["random caching, eviction and lookups answer like labkit's"]
    assert "your code raised KeyError" in text and "self.index[digest]" in text
    assert "the smallest one hypothesis found" in text


def test_ex8_a_miss_named_when_every_block_hit_is_named():
    text = failing(8, MissNewWhenAllHit)[1]["match returns the cached blocks of the longest cached prefix"]
    assert "miss=None)" in text and "miss='new')" in text and "miss is None then, not 'new'" in text


def test_ex8_the_learners_cache_plugged_into_the_engine_gives_labkits_tokens(bundled):
    # A cache written from the contract (the reference's own methods, copied into a subclass) serves a
    # shared prompt through allocator_for(...): the same hits and the same tokens as labkit's own engine.
    from labkit.exercises.ex8_block_hashing import allocator_for

    class Copied(PrefixCache):
        block_hash = staticmethod(prefix_cache.block_hash)

        def match(self, request):
            return PrefixCache.match(self, request)

    model, tokenizer = bundled
    system = "You are a helpful assistant who answers in the manner of Shakespeare's players.\n" * 2
    prompts = [system + speaker for speaker in ("ROMEO:\n", "JULIET:\n", "Nurse:\n", "BRUTUS:\n")]
    params = [SamplingParams(max_new_tokens=16, temperature=0.8, seed=i) for i in range(len(prompts))]
    config = EngineConfig(block_size=8, num_blocks=48, max_batch_tokens=64, max_num_seqs=4, enable_prefix_caching=True)
    plain = Engine(model, config, tokenizer).generate(prompts, params)
    plugged_engine = Engine(model, config, tokenizer, allocator_cls=allocator_for(Copied))
    assert isinstance(plugged_engine.allocator.prefix_cache, Copied)
    plugged = plugged_engine.generate(prompts, params)
    assert [o.output_token_ids for o in plugged] == [o.output_token_ids for o in plain]
    assert [o.num_cached_tokens for o in plugged] == [o.num_cached_tokens for o in plain]
    assert sum(o.num_cached_tokens for o in plain) > 0


# ------------------------------------------------------------------ exercise 9: planted mistakes
class RecomputesTheKeyAtRequeue(ShortestFirstQueue):
    """Ranks a preempted request again, as if it arrived at the last step the queue saw."""

    last_step = 0

    def add(self, request, step):
        self.last_step = step
        super().add(request, step)

    def requeue(self, request):
        key = (*self.rank(request, self.last_step), next(self._arrivals))
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=operator.itemgetter(0))


class NewestFirstOnTies(ShortestFirstQueue):
    def add(self, request, step):
        key = (*self.rank(request, step), -next(self._arrivals))
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=operator.itemgetter(0))


class AgeingSubtracted(ShortestFirstQueue):
    def rank(self, request, step):
        return (request.num_prompt_tokens + request.params.max_new_tokens - self.ageing * step,)


class RequeuesToTheFront(ShortestFirstQueue):
    """Puts a preempted request first in line, as first come first served does."""

    def requeue(self, request):
        self._entries.insert(0, (self.key(request), request))


class IterationPops(ShortestFirstQueue):
    def __iter__(self):
        while self._entries:
            yield self._entries.pop(0)[1]


class PromptOnly(ShortestFirstQueue):
    """Ranks by the prompt alone, not the tokens the request will generate."""

    def rank(self, request, step):
        return (request.num_prompt_tokens + self.ageing * step,)


class ForgetsWithDel(ShortestFirstQueue):
    def forget(self, request):
        del self._keys[request.request_id]


class RequeuesWithANewArrivalNumber(ShortestFirstQueue):
    """Keeps the rank at requeue but draws a new arrival number: ties now go against the request that waited."""

    def requeue(self, request):
        key = (*self.key(request)[:-1], next(self._arrivals))
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=operator.itemgetter(0))


class RequeuesAsIfNewAtStepZero(ShortestFirstQueue):
    """requeue has no step, so it adds the request again as if it arrived at step 0."""

    def requeue(self, request):
        self.add(request, 0)


class NoArrivalNumber(ShortestFirstQueue):
    """Keys of the rank alone: insort puts a requeued request after every waiting one of the same rank."""

    def add(self, request, step):
        key = self.rank(request, step)
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=operator.itemgetter(0))


class TiesByRequestId(ShortestFirstQueue):
    def add(self, request, step):
        key = (*self.rank(request, step), request.request_id)
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=operator.itemgetter(0))


class AgeingCutToAWholeNumber(ShortestFirstQueue):
    def rank(self, request, step):
        return (request.num_prompt_tokens + request.params.max_new_tokens + int(self.ageing) * step,)


def ex9_named(mistake, case, expected, got, *phrases):
    """The messages of every case ``mistake`` fails, after checking that ``case``'s shows ``expected`` and ``got``
    and says ``phrases``."""
    _, messages = failing(9, mistake)
    text = messages[case]
    assert f"expected: {expected}\n" in text and f"got:      {got}\n" in text, text
    assert all(phrase in text for phrase in phrases), text
    return messages


class ArrivalNumberFromTheLength(ShortestFirstQueue):
    """Numbers arrivals with len(self._entries), which goes down as requests leave: two requests share a number."""

    def add(self, request, step):
        key = (*self.rank(request, step), len(self._entries))
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=operator.itemgetter(0))


class LengthAsText(ShortestFirstQueue):
    def __len__(self):
        return str(len(self._entries))


def test_ex9_an_arrival_number_that_does_not_only_count_up_is_named():
    name = "the key ends with an arrival number that only counts up"
    ex9_named(ArrivalNumberFromTheLength, name, "(20, 2)", "(20, 1)", "next(self._arrivals)", "len(self._entries)")
    ex9_named(NoArrivalNumber, name, "(20, 0)", "(20,)", "arrival number included")


def test_ex9_a_len_that_is_no_int_or_wrong_is_named_whatever_the_case():
    name = "the fewest expected tokens (prompt + max_new_tokens) go first"
    ex9_named(LengthAsText, name, "an int", "len(queue) raised TypeError: 'str' object cannot be interpreted as an"
              " integer", "len(queue) is how many requests wait")  # fmt: skip


def test_ex9_a_key_computed_again_at_requeue_is_named():
    name = "a request keeps the key it arrived with: requeued later, it ranks as before"
    hint = ("keeps the key it arrived with", "self._keys[request.request_id]", "queue.requeue(r0)")
    messages = ex9_named(RecomputesTheKeyAtRequeue, name, "[r0, r1, r2]", "[r1, r0, r2]", *hint)
    engine = messages["inside the engine, a long request is admitted while short ones keep arriving"]
    assert "preempted [8]" in engine and "then the queue cases above" in engine
    assert "a preempted request goes back where its key ranks it, not to the front" not in messages


def test_ex9_ties_broken_newest_first_are_named():
    name, hint = "requests of the same rank go in arrival order", ("the earlier first", "next(self._arrivals)")
    messages = ex9_named(NewestFirstOnTies, name, "[r0, r4, r3, r1, r2]", "[r4, r0, r2, r1, r3]", *hint)
    assert "the fewest expected tokens (prompt + max_new_tokens) go first" not in messages
    ex9_named(TiesByRequestId, name, "[r0, r4, r3, r1, r2]", "[r0, r4, r1, r2, r3]", *hint)


def test_ex9_a_requeue_that_changes_any_part_of_the_key_is_named():
    """A new arrival number, a step of 0, or no arrival number at all: each ranks the requeued r0 against r4 and
    r2, which tie with it, by something other than when each arrived."""
    name = "a requeued request keeps its arrival number, and the step it arrived at"
    hint = ("its arrival number included", "self._keys[request.request_id]")
    ex9_named(RequeuesWithANewArrivalNumber, name, "[r1, r4, r0, r2, r3]", "[r1, r4, r2, r0, r3]", *hint)
    ex9_named(RequeuesAsIfNewAtStepZero, name, "[r1, r4, r0, r2, r3]", "[r0, r1, r4, r2, r3]", *hint)
    ex9_named(NoArrivalNumber, name, "[r1, r4, r0, r2, r3]", "[r1, r4, r2, r0, r3]", *hint)


def test_ex9_an_ageing_cut_to_a_whole_number_is_named():
    text = only_failure(9, AgeingCutToAWholeNumber, "ageing is the value the queue was made with")
    assert "queue = AgeingCutToAWholeNumber(ageing=2.5)" in text and "expected: (50.0,)" in text
    assert "got:      (44,)" in text and "Use self.ageing" in text


def test_ex9_ageing_subtracted_is_named():
    name = "each step a request has waited is worth ageing tokens of head start"
    messages = ex9_named(AgeingSubtracted, name, "[r2, r0, r1, r3]", "[r3, r1, r2, r0]", "plus, not minus")
    assert "expected: (50.0,)" in messages["ageing is the value the queue was made with"]
    assert "the fewest expected tokens (prompt + max_new_tokens) go first" not in messages


def test_ex9_a_requeue_to_the_front_is_named():
    name = "a preempted request goes back where its key ranks it, not to the front"
    hint = "not to the front as first come first served does"
    messages = ex9_named(RequeuesToTheFront, name, "[r2, r0, r3]", "[r0, r2, r3]", hint)
    assert set(messages) == {
        name,
        "a requeued request keeps its arrival number, and the step it arrived at",
        "random arrivals, admissions, preemptions and finishes keep labkit's order",
    }


def test_ex9_an_iteration_that_takes_requests_out_is_named_in_every_case():
    _, messages = failing(9, IterationPops)
    text = messages["iterating over the queue takes nothing out"]
    assert "expected: [r1, r2, r0] again" in text and "got:      []" in text
    assert "__iter__ must not take anything out" in text
    engine = messages["inside the engine, a long request is admitted while short ones keep arriving"]
    assert "the waiting queue [r1, r2, r3, r0] again" in engine and "__iter__ must not take anything out" in engine
    assert all("__iter__ must not take anything out" in m for m in messages.values())


def test_ex9_a_rank_of_the_prompt_alone_and_a_forget_that_raises_are_named():
    _, messages = failing(9, PromptOnly)
    text = messages["the fewest expected tokens (prompt + max_new_tokens) go first"]
    assert "queue.rank(r0, step=0)" in text and "expected: (30,)" in text and "got:      (10,)" in text
    assert "prompt and output both" in text
    text = only_failure(9, ForgetsWithDel, "forget drops the key of a finished request")
    assert "your code raised KeyError: 7" in text and "self._keys.pop(request.request_id, None)" in text


def test_ex9_without_ageing_the_long_request_starves_and_the_case_says_so():
    from labkit.exercises.ex9_shortest_first import _STARVED_HINT

    class NoAgeing(ShortestFirstQueue):
        def __init__(self, ageing=0):
            super().__init__(0)

    _, messages = failing(9, NoAgeing)
    text = messages["inside the engine, a long request is admitted while short ones keep arriving"]
    assert "admitted [0, 7]" in text.split("got:")[0] and _STARVED_HINT in text


def test_ex9_the_learners_queue_plugged_into_the_engine_gives_labkits_tokens(bundled):
    # A queue written from the contract (the reference's own methods, copied into a subclass of FcfsQueue) orders
    # a mixed workload through scheduler_for(...): the same admissions and tokens as labkit's own shortest-first.
    from labkit.core.queues import AGEING, FcfsQueue
    from labkit.exercises.ex9_shortest_first import scheduler_for

    class Copied(FcfsQueue):
        def __init__(self, ageing=AGEING):
            self.ageing, self._entries, self._keys, self._arrivals = ageing, [], {}, itertools.count()

        def rank(self, request, step):
            return (request.num_prompt_tokens + request.params.max_new_tokens + self.ageing * step,)

        def add(self, request, step):
            self._keys[request.request_id] = key = (*self.rank(request, step), next(self._arrivals))
            bisect.insort(self._entries, (key, request), key=operator.itemgetter(0))

        def requeue(self, request):
            bisect.insort(self._entries, (self._keys[request.request_id], request), key=operator.itemgetter(0))

        appendleft = append = requeue

        def remove(self, request):
            self._entries.remove((self._keys[request.request_id], request))

        def __iter__(self):
            return (request for _, request in self._entries)

        def __len__(self):
            return len(self._entries)

        def forget(self, request):
            self._keys.pop(request.request_id, None)

    assert check(9, Copied, quiet=True).passed

    model, tokenizer = bundled
    prompts = ["ROMEO:\n" * 6, "JULIET:\n", "Nurse:\n" * 3, "BRUTUS:\n", "KING RICHARD III:\n" * 2, "LADY ANNE:\n"]
    params = [SamplingParams(max_new_tokens=4 + 6 * (i % 3), temperature=0.8, seed=i) for i in range(len(prompts))]
    config = EngineConfig(block_size=4, num_blocks=24, max_batch_tokens=32, max_num_seqs=2, scheduling="shortest-first")
    plain = Engine(model, config, tokenizer)
    plugged = Engine(model, config, tokenizer, scheduler_cls=scheduler_for(Copied))
    assert isinstance(plugged.scheduler.waiting, Copied)
    orders = []
    for engine in (plain, plugged):
        reports = []
        engine.step_listeners.append(reports.append)
        outputs = engine.generate(prompts, params)
        orders.append(([r.admitted for r in reports], [o.output_token_ids for o in outputs]))
    assert orders[0] == orders[1]
    assert [a for admitted in orders[0][0] for a in admitted][:2] != [0, 1]  # not first come, first served


# ------------------------------------------------------------------ feedback, files, CLI
def test_a_learner_error_is_shown_as_the_learners_own_without_labkit_frames():
    def broken(segments, block_size, scratch):
        return [segment.block_tabel for segment in segments]  # a typo

    result = check(2, broken, quiet=True)
    message = result.failures[0].message()
    assert "your code raised AttributeError" in message and "block_tabel" in message
    assert "in broken" in message and "labkit/exercises" not in message and "Segment(start=" in message
    verbose = check(2, broken, quiet=True, verbose=True).failures[0].message()
    assert "labkit/exercises" in verbose  # the whole traceback when asked


def test_a_case_that_runs_too_long_is_stopped_and_the_cases_after_it_are_not_run(monkeypatch):
    """An endless loop in a learner's code would hang the check, and an instructor's run over a class's files:
    the case is stopped after CASE_SECONDS, showing where it was, and the exercise's later cases are not run."""
    monkeypatch.setattr(framework, "CASE_SECONDS", 0.5)

    def endless(segments, block_size, scratch_slot):
        while True:
            pass

    start = time.perf_counter()
    result = check(2, endless, quiet=True)
    assert time.perf_counter() - start < 10
    first, *rest = result.failures
    assert first.kind == "out of time" and "in endless" in first.traceback and "while True" in first.traceback
    assert len(rest) == result.num_cases - 1 and all(f.got.startswith("not run") for f in rest)
    assert result.num_passed == 0 and result.status == "failing"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left set after the check
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL


def test_a_check_stopped_by_the_learner_shows_where_their_code_was():
    """A learner whose check seems to hang presses stop: a bare KeyboardInterrupt through labkit's frames hid the
    line their loop was on, and left the notebook's ``result`` undefined for the cells after it."""

    def endless(segments, block_size, scratch_slot):
        while True:
            pass

    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        result = check(2, endless, quiet=True)
    finally:
        timer.cancel()
    first, *rest = result.failures
    assert first.kind == "stopped" and "you stopped the check" in first.got
    assert "in endless" in first.traceback and "while True" in first.traceback
    assert len(rest) == result.num_cases - 1 and all(f.got == "not run: a check before it was stopped" for f in rest)
    assert result.status == "failing" and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


ENDLESS_SLOT_MAPPING = "def slot_mapping(segments, block_size, scratch_slot):\n    while True:\n        pass\n"
ENDLESS_ATTENTION = "def paged_attention(q, k, v, table, context_len, scale):\n    while True:\n        pass\n"


def test_a_ctrl_c_stops_labkit_check_after_the_exercise_it_stopped(tmp_path, capsys):
    """One Ctrl-C per exercise was needed to stop labkit check: it went on to the next exercise's cases."""
    (tmp_path / "ex2_slot_mapping.py").write_text(ENDLESS_SLOT_MAPPING)
    (tmp_path / "ex5_paged_attention.py").write_text(ENDLESS_ATTENTION)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        assert main(["check", "2", "5", "--path", str(tmp_path)]) == 130
    finally:
        timer.cancel()
    out = capsys.readouterr().out
    assert "Stopped: the exercises after it were not checked." in out
    rows = [line.split()[1] for line in out.splitlines() if re.match(r"│ \d │", line)]
    assert rows == ["2"] and "you stopped the check" in out and "while True" in out
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:  # the last exercise named, or the only one: stopped all the same
        assert main(["check", "5", "--path", str(tmp_path)]) == 130
    finally:
        timer.cancel()
    assert capsys.readouterr().out.rstrip().endswith("Stopped.")


def test_a_ctrl_c_stops_the_learners_pytest_run(monkeypatch, capsys):
    """pytest -m exN exercises/: a stopped case became one failed test, and pytest went on to the next case."""
    sys.path.insert(0, str(STUBS))
    try:
        with warnings.catch_warnings():  # its exN marks are registered by exercises/conftest.py, not loaded here
            warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
            import test_my_exercises
    finally:
        sys.path.remove(str(STUBS))
    stopped = framework.Failure("a case", "stopped", got="you stopped the check", traceback="  line 3, in mine")
    monkeypatch.setattr(test_my_exercises, "run_case", lambda case, implementation: stopped)
    monkeypatch.setattr(test_my_exercises, "load_implementation", lambda exercise: (object(), "", ""))
    with pytest.raises(KeyboardInterrupt):
        test_my_exercises.test_exercise(2, get(2).cases[0].name)
    assert "you stopped the check" in capsys.readouterr().out


def test_a_learners_file_that_never_finishes_loading_is_stopped(tmp_path, monkeypatch):
    """A loop at a file's top level hung labkit check for good, and a class check for half an hour a learner."""
    monkeypatch.setattr(framework, "CASE_SECONDS", 0.5)
    (tmp_path / "ex2_slot_mapping.py").write_text("while True:\n    pass\n")
    _, _, error = load_implementation(get(2), tmp_path)
    assert error.startswith("your file was still loading after") and "while True" in error
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_labkit_check_json_stays_json_when_a_learners_subprocess_prints(tmp_path, capfd):
    """os.system() writes to the process's stdout itself, past sys.stdout."""
    (tmp_path / "ex1_block_allocator.py").write_text(
        "import os\n\nos.system('echo from a shell')\n" + DELEGATING_ALLOCATOR
    )
    assert main(["check", "1", "--json", "--path", str(tmp_path)]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)[0]["status"] == "passed" and "from a shell" in err


def test_check_prints_feedback_and_imports_the_file_afresh(tmp_path, capsys):
    file = tmp_path / "ex2_slot_mapping.py"
    file.write_text("def slot_mapping(segments, block_size, scratch_slot):\n    return []\n")
    result = check(2, path=tmp_path)
    assert result.status == "failing" and "✗ a prompt's first token" in capsys.readouterr().out
    file.write_text(DELEGATING_SLOT_MAPPING)
    assert check(2, path=tmp_path, quiet=True).passed
    file.write_text("def slot_mapping(:\n")
    broken = check(2, path=tmp_path, quiet=True)
    assert broken.status == "failing" and "your file does not load: SyntaxError" in broken.load_error
    _, _, missing = load_implementation(get(2), tmp_path / "nowhere")
    assert "check(2, slot_mapping)" in missing


def test_a_sys_exit_in_the_learners_code_is_their_error_not_the_checks_end(tmp_path):
    """sys.exit() raises SystemExit, which is no Exception: it ended labkit check (no table) and a notebook's
    check(); at import or inside a case it is the learner's error, reported as any other."""
    file = tmp_path / "ex2_slot_mapping.py"
    file.write_text("import sys\nsys.exit('done')\n")
    at_import = check(2, path=tmp_path, quiet=True)
    assert at_import.status == "failing" and "your file does not load: SystemExit: done" in at_import.load_error

    def exits(segments, block_size, scratch_slot):
        raise SystemExit(3)

    in_a_case = check(2, exits, quiet=True)
    assert in_a_case.num_passed == 0 and len(in_a_case.failures) == in_a_case.num_cases
    assert all(f.kind == "error" and "raised SystemExit: 3" in f.got for f in in_a_case.failures)


@pytest.mark.parametrize("exercise", list(exercises().values()), ids=lambda e: f"ex{e.number}")
def test_a_file_that_hands_in_labkits_own_code_is_not_passed(exercise, tmp_path):
    """labkit's code passes every check, so a file whose class inherits every seam (``pass`` for a body), or that
    imports labkit's function, is "not started", and one that leaves a seam out is failing, naming it: a learner
    who deleted a stub, or an instructor collecting work, would otherwise read "passed"."""
    reference = exercise.reference()
    file = tmp_path / exercise.filename
    if exercise.seams:
        header = f"from {reference.__module__} import {reference.__name__}\n\n\n"
        file.write_text(f"{header}class {exercise.export}({reference.__name__}):\n    pass\n")
    else:
        file.write_text(f"from {reference.__module__} import {reference.__name__} as {exercise.export}\n")
    result = check_file(exercise, tmp_path)
    assert result.status == "not started" and not result.passed, result.load_error
    assert all(f"{name}()" in result.load_error for name in exercise.seams or [exercise.export])
    if len(exercise.seams) > 1:
        kept, *left_out = exercise.seams
        body = f"    def {kept}(self, *args, **kwargs):\n        return super().{kept}(*args, **kwargs)\n"
        file.write_text(f"{header}class {exercise.export}({reference.__name__}):\n{body}")
        result = check_file(exercise, tmp_path)
        assert result.status == "failing" and all(f"{name}()" in result.load_error for name in left_out)
        assert f"{kept}()" not in result.load_error


def test_each_exercise_names_the_methods_its_stub_defines():
    """``Exercise.seams`` are the methods of the stub's class (none where the stub is a function): what a learner's
    file must define itself."""
    for exercise in exercises().values():
        tree = ast.parse((STUBS / exercise.filename).read_text())
        [export] = [n for n in tree.body if getattr(n, "name", None) == exercise.export]
        methods = tuple(n.name for n in getattr(export, "body", []) if isinstance(n, ast.FunctionDef))
        assert exercise.seams == methods, exercise.number


def test_a_second_save_of_the_same_length_within_the_same_second_is_checked(tmp_path, monkeypatch):
    """Python's cached bytecode is matched to a file by its size and mtime in whole seconds: a quick second save of
    the same length (a typo fixed, ``<`` for ``>``) must not run the version before it."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as on a learner's machine: .pyc files get written
    file = tmp_path / get(2).filename
    file.write_text("def slot_mapping(segments, block_size, scratch_slot):\n    return [1]\n")
    before = file.stat()
    assert load_implementation(get(2), tmp_path)[0]([], 1, 0) == [1]
    file.write_text("def slot_mapping(segments, block_size, scratch_slot):\n    return [2]\n")
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))  # saved again within the same second
    assert file.stat().st_size == before.st_size
    assert load_implementation(get(2), tmp_path)[0]([], 1, 0) == [2]


# Files that pass: each defines the exercise's code itself, by calling labkit's (a file that only imports labkit's
# code is "not started").
DELEGATING_ALLOCATOR = """from labkit.core.blocks import BlockAllocator


class MyBlockAllocator(BlockAllocator):
    def allocate(self, *args, **kwargs):
        return super().allocate(*args, **kwargs)

    def free(self, request_id):
        return super().free(request_id)
"""
DELEGATING_SLOT_MAPPING = """from labkit.runtime import attention


def slot_mapping(*args):
    return attention.slot_mapping(*args)
"""


def test_check_path_takes_a_learners_whole_checkout(tmp_path):
    """An instructor collecting a class's work gets each learner's checkout: ``--path`` finds the files in its
    exercises/ folder, unless the folder itself holds them."""
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / get(1).filename).write_text(DELEGATING_ALLOCATOR)
    assert check_file(get(1), tmp_path).passed
    (tmp_path / get(1).filename).write_text((STUBS / get(1).filename).read_text())  # files at the top win
    assert check_file(get(1), tmp_path).status == "not started"


def test_a_missing_file_is_told_from_an_untouched_stub(tmp_path, capsys, monkeypatch):
    """An instructor checking a learner's folder sees "no file" where the learner handed nothing in, and "not
    started" where the stub came back untouched; the table names the folder it checked."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ada").mkdir()
    (tmp_path / "ada" / get(1).filename).write_text((STUBS / get(1).filename).read_text())
    assert check_file(get(1), "ada").status == "not started"
    assert check_file(get(2), "ada").status == "no file"
    assert main(["check", "1", "2", "--path", "ada"]) == 1
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if re.match(r"│ \d │", line)}
    assert "not started" in rows["1"] and "no file" in rows["2"]
    assert "labkit exercises, in course order, in ada" in out


def test_labkit_check_prints_progress_and_json(tmp_path, capsys):
    (tmp_path / "ex1_block_allocator.py").write_text(DELEGATING_ALLOCATOR)
    for number in NUMBERS[1:]:
        name = get(number).filename
        (tmp_path / name).write_text((STUBS / name).read_text())
    assert main(["check", "--path", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "Block allocator" in out and "passed" in out and "not started" in out and "1 of 9 exercises pass" in out
    rows = [line.split()[1] for line in out.splitlines() if re.match(r"│ \d │", line)]
    assert rows == ["6", "7", "1", "2", "5", "3", "4", "8", "9"], "the table lists the exercises in course order"
    assert "Next: exercise 6, after notebook 01. Its feedback: labkit check 6" in out, "the first that does not pass"
    assert main(["check", "2", "--path", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "0 of 1 exercises pass" in out and 'raises NotImplementedError("Exercise 2")' in out, "its feedback"
    assert "Next:" not in out
    assert main(["check", "1", "--json", "--path", str(tmp_path)]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["status"] == "passed" and entry["passed"] == entry["cases"] == len(get(1).cases)
    assert entry["after_notebooks"] == ["03"]


def test_labkit_check_json_stays_json_when_the_learners_code_prints(tmp_path, capsys):
    """A debugging print() in a learner's file went to stdout before the JSON, which no script could read then."""
    printing = DELEGATING_ALLOCATOR.replace(
        "        return super().allocate", "        print('allocating')\n        return super().allocate"
    )
    (tmp_path / "ex1_block_allocator.py").write_text("print('loaded')\n" + printing)
    assert main(["check", "1", "--json", "--path", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    [entry] = json.loads(out)
    assert entry["status"] == "passed"
    assert err.startswith("loaded\nallocating\n")


def test_labkit_check_class_checks_each_learner_apart_into_one_table(tmp_path, capsys):
    """Learners' code runs in the checking process: one that patches labkit, or ends the process, must not reach
    the next learner's checks."""
    learners = {name: tmp_path / "class" / name for name in ("a_patches", "b_crashes", "c_passes")}
    for folder in [*learners.values(), tmp_path / "class" / ".ipynb_checkpoints"]:
        folder.mkdir(parents=True)
    patch = "from labkit.core.blocks import BlockAllocator\n\nBlockAllocator.allocate = None\n"
    (learners["a_patches"] / "ex2_slot_mapping.py").write_text(patch)
    (learners["b_crashes"] / "ex1_block_allocator.py").write_text("import os\n\nos._exit(3)\n")
    (learners["c_passes"] / "ex1_block_allocator.py").write_text(DELEGATING_ALLOCATOR)
    marked_up = tmp_path / "class" / "[draft] d"  # a name, and an error, that rich would read as markup
    marked_up.mkdir()
    (marked_up / "ex1_block_allocator.py").write_text(
        "import os\nimport sys\n\nprint('saving to [/tmp/out]', file=sys.stderr, flush=True)\nos._exit(4)\n"
    )
    assert main(["check", "--class", str(tmp_path / "class"), "2", "1", "--json"]) == 1
    out, err = capsys.readouterr()
    found = json.loads(out)
    assert list(found) == ["[draft] d", *learners]
    assert found["[draft] d"] == "the check did not finish (exit status 4): saving to [/tmp/out]"
    assert [(e["exercise"], e["status"]) for e in found["a_patches"]] == [(1, "no file"), (2, "failing")]
    assert found["b_crashes"] == "the check did not finish (exit status 3)"
    assert [(e["exercise"], e["status"]) for e in found["c_passes"]] == [(1, "passed"), (2, "no file")]
    assert "checking c_passes (4 of 4)" in err
    assert main(["check", "--class", str(tmp_path / "class"), "1", "2"]) == 1
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if "│" in line}
    assert [cell.strip() for cell in rows["c_passes"].split("│")[2:5]] == ["✓", "-", "1/2"]
    assert "exit status 3" in rows["b_crashes"]
    assert "│ [draft] d │" in out and "[/tmp/out]" in out
    with pytest.raises(SystemExit):
        main(["check", "--class", str(learners["c_passes"])])  # a folder of files, not of learners
    assert "no subfolders" in capsys.readouterr().err


def test_labkit_check_watch_checks_an_exercise_again_each_time_its_file_is_saved(tmp_path, capsys):
    """The learner saves a wrong solution, then a right one: each save is checked at once; an untouched file is not."""
    from rich.console import Console

    from labkit.exercises.command import watch

    stub = tmp_path / get(2).filename
    stub.write_text((STUBS / get(2).filename).read_text())
    (tmp_path / get(1).filename).write_text((STUBS / get(1).filename).read_text())
    saves = [
        "def slot_mapping(segments, block_size, scratch_slot):\n    return []\n",
        DELEGATING_SLOT_MAPPING,
    ]

    def learner_at_work(seconds: float) -> None:  # stands in for time.sleep between looks at the files
        if not saves:
            raise KeyboardInterrupt
        stub.write_text(saves.pop(0))

    chosen = [get(1), get(2)]
    first = [check_file(exercise, tmp_path) for exercise in chosen]
    latest = watch(chosen, first, str(tmp_path), Console(width=100), sleep=learner_at_work)
    out = capsys.readouterr().out
    assert [r.status for r in latest] == ["not started", "passed"]
    assert out.count("exercise 2 saved") == 2 and "exercise 1 saved" not in out
    assert "exercise 2 saved: failing" in out and "exercise 2 saved: passed" in out
    assert "✓ all" in out and "1 of 2 exercises pass" in out and "Stopped watching" in out
    with pytest.raises(SystemExit):
        main(["check", "--watch", "--json"])
    assert "--watch prints for a person" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # every exercise was "not started", exit status 1
        main(["check", "--path", str(tmp_path / "nowhere")])
    assert refused.value.code == 2 and "nowhere: no such folder" in capsys.readouterr().err


# ------------------------------------------------------------------ the references inside the engine
@pytest.fixture(scope="module")
def bundled():
    from labkit.models import load

    torch.set_num_threads(1)
    return load("tiny-shakespeare")


def test_references_plugged_into_every_seam_give_labkits_tokens(bundled):
    model, tokenizer = bundled
    prompts = ["ROMEO:\n", "JULIET:\n", "Nurse:\n", "BRUTUS:\n", "KING RICHARD III:\n"]
    params = [SamplingParams(max_new_tokens=60, temperature=0.8, top_k=20, top_p=0.9, seed=i) for i in range(5)]
    for policy in ("continuous", "static"):
        config = EngineConfig(block_size=4, num_blocks=24, max_batch_tokens=32, max_num_seqs=4, policy=policy)
        plain = Engine(model, config, tokenizer).generate(prompts, params)
        plugged = Engine(
            model,
            config,
            tokenizer,
            allocator_cls=reference(1),
            scheduler_cls=reference(3),
            slot_mapping_fn=reference(2),
            attention_fn=reference(5),
            sampler=reference(6)(),
        ).generate(prompts, params)
        assert [o.output_token_ids for o in plugged] == [o.output_token_ids for o in plain]
        if policy == "continuous":
            assert sum(o.metrics.num_preemptions for o in plain) > 0  # the small cache exercises preemption


def test_the_fast_attention_path_agrees_with_paged_attention(tiny_model):
    model = tiny_model()
    config = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=24, max_num_seqs=4, dtype="float32")
    prompts = [[5 + i + j for j in range(3 + 5 * i)] for i in range(4)]
    params = SamplingParams(max_new_tokens=12)
    fast = Engine(model, config).generate(prompts, params)
    slow = Engine(model, config, attention_fn=paged_attention).generate(prompts, params)
    assert [o.output_token_ids for o in slow] == [o.output_token_ids for o in fast]


def test_seams_refuse_what_they_cannot_use(tiny_model):
    from labkit.core.sim import SimulatedModel

    with pytest.raises(TypeError, match="attention_fn: a SimulatedModel computes no attention"):
        Engine(SimulatedModel(), EngineConfig(num_blocks=8), attention_fn=paged_attention)
    with pytest.raises(TypeError, match="sampler must be callable"):
        Engine(tiny_model(), EngineConfig(num_blocks=8), sampler=3)
    bad = Engine(tiny_model(), EngineConfig(num_blocks=8), attention_fn=lambda q, k, v, t, n, s: q[:, :1, :1])
    bad.add_request([3, 4, 5], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="attention_fn must return a tensor of the query's shape"):
        bad.step()


def test_an_exception_in_learner_code_surfaces_as_its_own(tiny_model):
    def broken(segments, block_size, scratch_slot):
        raise ZeroDivisionError("learner's bug")

    model = tiny_model()
    engine = Engine(model, EngineConfig(num_blocks=8), slot_mapping_fn=broken)
    request_id = engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=2))
    with pytest.raises(ZeroDivisionError, match="learner's bug"):
        engine.step()
    engine.runner.slot_mapping_fn = slot_mapping  # the learner fixes the bug: the same engine carries on
    while engine.has_unfinished():
        engine.step()
    expected = Engine(model, EngineConfig(num_blocks=8)).generate([[3, 4, 5]], SamplingParams(max_new_tokens=2))
    assert engine.output(request_id).output_token_ids == expected[0].output_token_ids
