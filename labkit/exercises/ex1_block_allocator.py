"""Checks for exercise 1, the block allocator: allocate and free over a free-block queue with reference counts.

Every case replays a list of operations on the learner's allocator and on labkit's BlockAllocator and
compares, after each one, what came back and the allocator's state. A free that leaves the right blocks in
the free queue but in another order is named as such, whichever case it turns up in, and so is an allocate that
takes blocks off the free queue into no block table: inside the engine too, where the cache then runs dry as if
free had lost them.
"""

from __future__ import annotations

from typing import Any

from labkit.core.blocks import BlockAllocator, NoFreeBlocksError, blocks_for
from labkit.exercises.engine_runs import MAX_STEPS
from labkit.exercises.framework import Case, Exercise, Mismatch, learner_frames, property_case, showing

# ("allocate", request, num_tokens), ("free", request), ("append_slot", request), ("share", ...), ("step", n)
Op = tuple[Any, ...]


def _apply(allocator: Any, op: Op) -> Any:
    kind, *args = op
    if kind == "share":  # what prefix caching does: request b starts with a's first block, one more reference
        source, target = args
        block = allocator.block_tables[source][0]
        allocator.block_tables[target] = [block]
        allocator.ref_counts[block] += 1
        allocator.num_slots[target] = allocator.block_size
        return None
    if kind == "step":  # what the scheduler does before planning each step: events carry that step
        allocator.step = args[0]
        return None
    try:
        return getattr(allocator, kind)(*args)
    except (KeyError, NoFreeBlocksError) as error:
        return type(error)


def _state(allocator: Any) -> dict[str, Any]:
    return {
        "free queue": list(allocator.free_blocks),
        "block tables": {k: list(v) for k, v in allocator.block_tables.items()},
        "ref counts": list(allocator.ref_counts),
        "num_slots": dict(allocator.num_slots),
    }


def _show(value: Any) -> str:
    if isinstance(value, LabkitRaised):
        return f"raises {value}"
    return f"raises {value.__name__}" if isinstance(value, type) else f"returns {value!r}"


class LabkitRaised(Exception):
    """An error raised inside one of labkit's own methods (append_slot) because of what the learner's allocate did."""


def _op_text(op: Op) -> str:
    kind, *args = op
    if kind == "share":
        return f"# request {args[1]!r} shares the first block of {args[0]!r} (as prefix caching does)"
    if kind == "step":
        return f"allocator.step = {args[0]}  # the scheduler sets it before each step"
    return f"{kind}({', '.join(map(repr, args))})"


FREE_ORDER_HINT = (
    "self.free_blocks is first in, first out: free appends each released block, in table order, to the right"
    " end (append, not appendleft) and allocate pops from the left, so a block freed now is handed out only"
    " after every block that was already free. vLLM's free queue works the same way: there a freed block may"
    " still hold cached keys and values that a later request can hit until it is handed out again, and"
    " reusing the least recently freed block first keeps the freshest ones longest"
)


NUM_SLOTS_HINT = (
    "num_slots[request_id] is how many token slots the request has claimed: allocate sets it to num_tokens"
    " when that is more than before (never lower), a new request's entry too, even for 0 tokens, as it"
    " gets its empty block table; and free removes the request from num_slots as well as from block_tables"
)


REF_COUNT_HINT = (
    "self.ref_counts[block] is how many requests hold the block: allocate sets it to 1 for each block it takes"
    " from the free queue, and free subtracts 1 for each of the request's blocks, giving a block back only when"
    " its count reaches 0"
)


GROW_TABLE_HINT = (
    "allocate grows the request's block table: append the new blocks to the end of the table the request"
    " already has, instead of replacing the table with them (the earlier blocks still hold its first tokens)"
)


LOST_BLOCKS_HINT = (
    "allocate took {blocks} off the free queue without putting {it} in a block table, so no free can give {it}"
    " back: take exactly self.blocks_needed(request_id, num_tokens) blocks and append each one you take to the"
    " end of the request's table"
)


def _lost(free_queue: Any, tables: Any, num_blocks: int) -> list[int]:
    """The blocks in neither the free queue nor any block table: taken, and out of reach of every free."""
    held = set(free_queue).union(*tables)
    return [block for block in range(num_blocks) if block not in held]


def _blocks_count(count: int) -> str:
    return f"{count} block{'s' * (count != 1)}"


def _blocks(blocks: list[int]) -> str:
    return f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks}"


ALL_OR_NOTHING_HINT = (
    "check that enough blocks are free before taking any: raise NoFreeBlocksError and leave the free queue"
    " and the block tables exactly as they were"
)


EXACT_FIT_HINT = (
    "exactly enough free blocks is enough: raise only when more are needed than are free"
    " (self.blocks_needed(request_id, num_tokens) > len(self.free_blocks)), not when as many are needed as are free"
)


RELEASE_HINT = (
    "a block whose reference count stays above 0 after free is still in another request's table: it gets a"
    " BlockEvent('release', block, request_id, self.step), not 'free', and stays out of the free queue; 'free' is"
    " for the block whose last reference goes (its count reaches 0). The block map draws a 'free' block as empty"
)


RETURN_LIST_HINT = "return a list of block ids: {what}, not {kind}"
RETURNED = {
    "allocate": "the new blocks, in the order you took them ([] when none were needed)",
    "free": "the blocks that went back to the free queue, in table order",
}


def _lost_hint(lost: list[int], raised: bool = False) -> str:
    """What to fix when ``lost`` blocks are in neither the free queue nor a table after allocate: taking blocks
    and then raising breaks all-or-nothing; returning without recording them loses them."""
    if raised:
        return f"allocate took {_blocks(lost)} off the free queue and then raised: {ALL_OR_NOTHING_HINT}"
    return LOST_BLOCKS_HINT.format(blocks=_blocks(lost), it="it" if len(lost) == 1 else "them")


def _replaced_table(op: Op, want: dict[str, Any], have: dict[str, Any], before: dict[str, Any]) -> bool:
    """Whether the request's table after ``op`` is only the tail of labkit's: blocks it had before ``op`` (the state
    ``before``) were dropped. A request that had no blocks loses none: an empty table there is too few blocks."""
    if op[0] not in ("allocate", "append_slot"):
        return False
    had = before["block tables"].get(op[1]) or []
    theirs, mine = want["block tables"].get(op[1]), have["block tables"].get(op[1])
    if not had or theirs is None or mine is None or len(mine) >= len(theirs) or mine[: len(had)] == had:
        return False
    return theirs[len(theirs) - len(mine) :] == mine


TOO_FEW_HINT = (
    "num_tokens tokens fill ceil(num_tokens / block_size) blocks, the last one possibly part full"
    " (num_tokens // block_size drops that last, partial block). Take self.blocks_needed(request_id, num_tokens)"
    " blocks, the ones the request's table still lacks"
)
TOO_MANY_HINT = (
    "num_tokens tokens fill ceil(num_tokens / block_size) blocks and no more (num_tokens // block_size + 1 takes"
    " one too many when num_tokens fills its blocks exactly, or is 0). Take self.blocks_needed(request_id,"
    " num_tokens) blocks, the ones the request's table still lacks"
)


def _block_count_hint(call: str, took: int, need: int, free: int | None = None) -> str:
    """The hint for ``call`` (an allocate) that takes ``took`` new blocks where ``need`` are needed; with ``free``,
    it raised NoFreeBlocksError with that many blocks free (``took``: what it takes given enough)."""
    rule = TOO_FEW_HINT if took < need else TOO_MANY_HINT
    if free is not None:
        return (
            f"{call} needs {_blocks_count(need)} and {free} {'is' if free == 1 else 'are'} free, yet it raised"
            f" NoFreeBlocksError: given enough free blocks it takes {took}. {rule}"
        )
    return f"{call} took {_blocks_count(took)} where {need} {'is' if need == 1 else 'are'} needed: {rule}"


def _call_text(op: Op, before: dict[str, Any]) -> str:
    """The allocate call ``op`` makes: itself, or the one labkit's append_slot makes."""
    if op[0] == "append_slot":
        return f"allocate({op[1]!r}, {before['num_slots'].get(op[1], 0) + 1}) (called by append_slot({op[1]!r}))"
    return _op_text(op)


def _new_blocks(op: Op, table: dict[str, Any], before: dict[str, Any]) -> int | None:
    """How many blocks ``op`` added to its request's table, when that table only grew (None otherwise)."""
    had = before["block tables"].get(op[1]) or []
    now = table.get(op[1])
    if now is None or now[: len(had)] != had:
        return None
    return len(now) - len(had)


def _probe_taken(cls: Any, before: dict[str, Any], op: Op, block_size: int) -> int | None:
    """How many blocks the learner's allocate takes for ``op`` when the state is ``before`` and there are enough
    free blocks: for an allocate that raised NoFreeBlocksError, whether it asks for too many or raises at an exact
    fit. None when the probe cannot tell (it raised again, or did not grow the table)."""
    from collections import deque

    if op[0] not in ("allocate", "append_slot"):
        return None
    request = op[1]
    num_tokens = op[2] if op[0] == "allocate" else before["num_slots"].get(request, 0) + 1
    num_blocks = len(before["ref counts"])
    extra = blocks_for(num_tokens, block_size) + 2
    try:
        probe = cls(num_blocks + extra, block_size)
        probe.free_blocks = deque([*before["free queue"], *range(num_blocks, num_blocks + extra)])
        probe.block_tables = {k: list(v) for k, v in before["block tables"].items()}
        probe.ref_counts = [*before["ref counts"], *[0] * extra]
        probe.num_slots = dict(before["num_slots"])
        probe.allocate(request, num_tokens)
    except Exception:  # only a probe: the case reports what the real call did
        return None
    return _new_blocks(op, probe.block_tables, before)


TABLE_ORDER_HINT = (
    "free releases the request's blocks in table order, its first block first (not reversed): it returns them"
    " in that order and appends them to the right end of the free queue in that order, so that the queue stays"
    " first in, first out"
)


def _reordered(expected: Any, got: Any) -> bool:
    """Whether free returned the right blocks in another order."""
    return isinstance(got, list) and isinstance(expected, list) and got != expected and sorted(got) == sorted(expected)


def _not_a_list(expected: Any, got: Any) -> str:
    """What ``got`` is when labkit's method returned a list and the learner's returned something else; else ""."""
    if not isinstance(expected, list) or isinstance(got, (list, type, LabkitRaised)):  # a type: the error it raised
        return ""
    return "None" if got is None else f"a {type(got).__name__}"


def _shared_block_event(want: dict[str, Any], have: dict[str, Any]) -> bool:
    """Whether free recorded other events than labkit's "release" ones for the blocks another request still holds."""
    shared = [event for event in want["events"] if event[0] == "release"]
    blocks = {event[1] for event in shared}
    return bool(shared) and [event for event in have["events"] if event[1] in blocks] != shared


def _named_hint(
    op: Op,
    expected: Any,
    got: Any,
    differ: list[str],
    want: dict[str, Any],
    have: dict[str, Any],
    hint: str,
    before: dict[str, Any],
    taken: int | None = None,
) -> str:
    """The case's hint, unless the difference itself names the mistake: a method that returns no list, a table
    replaced instead of grown, blocks that allocate took into no table, an allocate that takes too few or too many
    blocks (``taken``: how many it takes, given enough free blocks, where it raised), one that raises with
    exactly enough blocks free, free's blocks in another order than the table's, num_slots alone, the reference
    counts alone, the free queue's order, or a shared block's event. ``before`` is the state before ``op``."""
    if (kind := _not_a_list(expected, got)) and op[0] in RETURNED:
        return RETURN_LIST_HINT.format(what=RETURNED[op[0]], kind=kind)
    if "block tables" in differ and _replaced_table(op, want, have, before):
        return GROW_TABLE_HINT
    lost = _lost(have["free queue"], have["block tables"].values(), len(have["ref counts"]))
    if op[0] in ("allocate", "append_slot") and lost:  # the state before op was labkit's, which loses none
        return _lost_hint(lost, raised=isinstance(got, type))  # _apply returns the type of an error allocate raised
    if op[0] in ("allocate", "append_slot") and "block tables" in differ and not isinstance(got, type):
        took, need = _new_blocks(op, have["block tables"], before), _new_blocks(op, want["block tables"], before)
        if took is not None and need is not None and took != need:
            return _block_count_hint(_call_text(op, before), took, need)
    if got is NoFreeBlocksError and isinstance(expected, list) and expected:
        free = len(before["free queue"])
        if taken is not None and taken > len(expected):
            return _block_count_hint(_call_text(op, before), taken, len(expected), free)
        if len(expected) == free:
            return EXACT_FIT_HINT
    if op[0] == "free" and _reordered(expected, got):
        return TABLE_ORDER_HINT
    if expected != got:
        return hint
    state = [k for k in differ if k != "events"]  # an event that differs is named once the state is right
    if state == ["num_slots"]:
        return NUM_SLOTS_HINT
    if state == ["ref counts"]:
        return REF_COUNT_HINT
    if op[0] == "free" and state == ["free queue"] and sorted(want["free queue"]) == sorted(have["free queue"]):
        return FREE_ORDER_HINT
    if state or op[0] != "free":
        return hint
    if _shared_block_event(want, have):
        return RELEASE_HINT
    if sorted(want["events"]) == sorted(have["events"]):
        return TABLE_ORDER_HINT
    return hint


def replay(cls: Any, num_blocks: int, block_size: int, ops: list[Op], hint: str, events: bool = False) -> None:
    """Run ``ops`` on ``cls`` and on labkit's allocator; raise a Mismatch at the first difference."""
    mine, ref = cls(num_blocks, block_size), BlockAllocator(num_blocks, block_size)
    done = [f"allocator = {getattr(cls, '__name__', 'allocator')}(num_blocks={num_blocks}, block_size={block_size})"]
    for op in ops:
        done.append(_op_text(op))
        showing("\n".join(done))
        before = _state(ref)  # the learner's too: every op before this one left both alike
        expected = _apply(ref, op)
        try:
            got = _apply(mine, op)
        except Exception as error:  # raised in labkit's own append_slot, which calls the learner's allocate
            if op[0] != "append_slot" or learner_frames(error):  # raised in the learner's own code: theirs
                raise
            got = LabkitRaised(
                f"{type(error).__name__} ({error}) in labkit's append_slot, which calls your"
                " allocate(request_id, num_slots + 1) and then looks the new token's block up in the block table"
            )
        want, have = _state(ref), _state(mine)
        if events:
            want["events"], have["events"] = (
                [tuple(e) for e in ref.drain_events()],
                [tuple(e) for e in mine.drain_events()],
            )
        if expected != got or want != have:
            differ = [k for k in want if want[k] != have[k]]
            expected_text = "\n".join([_show(expected)] + [f"{k}: {want[k]}" for k in differ])
            got_text = "\n".join([_show(got)] + [f"{k}: {have[k]}" for k in differ])
            taken = _probe_taken(cls, before, op, block_size) if got is NoFreeBlocksError else None
            named = _named_hint(op, expected, got, differ, want, have, hint, before, taken)
            raise Mismatch("\n".join(done), expected_text, got_text, named)


def _ops_case(name: str, num_blocks: int, block_size: int, ops: list[Op], hint: str, events: bool = False) -> Case:
    return Case(name, lambda cls: replay(cls, num_blocks, block_size, ops, hint, events), hint)


def _random_ops(example: tuple[int, int, list[tuple[int, int, int]]]) -> tuple[int, int, list[Op]]:
    num_blocks, block_size, raw = example
    kinds = ("allocate", "free", "append_slot")
    ops: list[Op] = []
    for kind, request, tokens in raw:
        name = "abc"[request]
        ops.append(("allocate", name, tokens) if kinds[kind] == "allocate" else (kinds[kind], name))
    return num_blocks, block_size, ops


def _property(cls: Any, example: Any) -> None:
    num_blocks, block_size, ops = _random_ops(example)
    replay(cls, num_blocks, block_size, ops, "compare the first operation where your allocator differs", events=True)


def _strategy() -> Any:
    from hypothesis import strategies as st

    op = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(1, 24))
    return st.tuples(st.integers(1, 8), st.integers(1, 4), st.lists(op, max_size=12))


ENGINE_HINT = (
    "the engine's scheduler calls allocate(request_id, num_tokens, prefix) with prefix=None (a match from the"
    " prefix cache only when prefix caching is on), blocks_needed and can_allocate before it, and free when a"
    " request finishes or is preempted: keep the stub's signatures, and leave num_slots and the block tables"
    " as allocate and free describe"
)


def _watch_allocate(allocator: Any) -> list[tuple[str, str, str]]:
    """Make ``allocator``'s allocate note its first call that does not grow the request's table from the one it had,
    after which blocks are in neither the free queue nor a block table, or that takes more or fewer blocks than
    the request lacks: (expected, got, hint), in the list returned."""
    found: list[tuple[str, str, str]] = []
    allocate = allocator.allocate

    def lost() -> list[int]:
        return _lost(allocator.free_blocks, allocator.block_tables.values(), allocator.num_blocks)

    def watched(request_id: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        table, before, raised = list(allocator.block_tables.get(request_id, ())), lost(), True
        needed, free = allocator.blocks_needed(request_id, num_tokens), len(allocator.free_blocks)
        try:
            result = allocate(request_id, num_tokens, *args, **kwargs)
            raised = False
            return result
        except NoFreeBlocksError:
            if not found and needed == free > 0 and not any(a is not None for a in (*args, *kwargs.values())):
                call = f"allocate({request_id!r}, {num_tokens}) in step {allocator.step}"
                want = f"{call} takes the {_blocks_count(needed)} it needs, with {free} free"
                found.append((want, f"{call} raised NoFreeBlocksError", EXACT_FIT_HINT))
            raise
        finally:
            call = f"allocate({request_id!r}, {num_tokens}) in step {allocator.step}"
            now, taken = allocator.block_tables.get(request_id, []), [b for b in lost() if b not in before]
            if not found and now[: len(table)] != table:
                found.append((f"{call} grows the table {table}", f"{call} left the table {now}", GROW_TABLE_HINT))
            elif not found and taken:
                where = f"{'is' if len(taken) == 1 else 'are'} in neither the free queue nor a block table"
                want = "every block that allocate takes from the free queue in a block table"
                found.append((want, f"after {call}, {_blocks(taken)} {where}", _lost_hint(taken, raised)))
            elif not found and not raised and not any(a is not None for a in (*args, *kwargs.values())):
                took = len(now) - len(table)
                if took != needed:  # no prefix: every block it adds is one it took from the free queue
                    want = f"{call} takes {_blocks_count(needed)}, as many as the request lacks"
                    found.append((want, f"{call} took {_blocks_count(took)}", _block_count_hint(call, took, needed)))

    allocator.allocate = watched
    return found


def serves_in_the_engine(cls: Any) -> None:
    """Serve a few requests on the simulated model with ``cls`` and with labkit's allocator; compare the outcome.

    The replayed cases call allocate and free directly; this one lets labkit's scheduler call them as a real
    step does, in a cache small enough that requests are preempted and recomputed.
    """
    from labkit.core.config import EngineConfig
    from labkit.core.engine import Engine
    from labkit.core.request import SamplingParams
    from labkit.core.sim import SimulatedModel

    knobs = {"block_size": 4, "num_blocks": 10, "max_batch_tokens": 32, "max_num_seqs": 4}
    config = EngineConfig(**knobs)
    prompts = [[2 + (5 * i + j) % 50 for j in range(3 + 2 * i)] for i in range(6)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    setup = (
        f"Engine(SimulatedModel(), EngineConfig({', '.join(f'{k}={v}' for k, v in knobs.items())}),"
        f" allocator_cls={getattr(cls, '__name__', 'allocator')})\n"
        f"engine.generate({len(prompts)} prompts of {', '.join(str(len(p)) for p in prompts)} tokens,"
        f" max_new_tokens={params.max_new_tokens})"
    )
    showing(setup)
    reference = Engine(SimulatedModel(), config)
    want = [(o.output_token_ids, o.metrics.num_preemptions) for o in reference.generate(prompts, params)]
    engine = Engine(SimulatedModel(), config, allocator_cls=cls)
    leaks = _watch_allocate(engine.allocator)  # a block that allocate loses is named as allocate's, not free's
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    steps = 0  # labkit's allocator takes 26; one that loses blocks can leave a request waiting for ever
    while engine.has_unfinished() and steps < MAX_STEPS:
        try:
            engine.step()
        except Exception:
            if not leaks:
                raise
        if leaks:  # what allocate lost comes first, also when the step then stopped on it
            raise Mismatch(setup, *leaks[0])
        steps += 1
    if engine.has_unfinished():
        raise Mismatch(
            setup,
            "every request finished",
            f"{sum(engine.output(i).finish_reason is None for i in ids)} of {len(ids)} requests unfinished after"
            f" {MAX_STEPS} steps, with {engine.num_free_blocks} of {engine.num_blocks} blocks free",
            "a request waits until enough blocks are free: free must give every block of a finished or"
            " preempted request back, or the cache runs dry",
        )
    got = [(engine.output(i).output_token_ids, engine.output(i).metrics.num_preemptions) for i in ids]
    if got != want:
        first = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
        raise Mismatch(
            setup,
            f"request {first}: tokens {want[first][0]}, preempted {want[first][1]} times",
            f"request {first}: tokens {got[first][0]}, preempted {got[first][1]} times",
            ENGINE_HINT,
        )
    if engine.num_free_blocks != engine.num_blocks:
        raise Mismatch(
            setup,
            f"after the run, all {engine.num_blocks} blocks free",
            f"{engine.num_free_blocks} of {engine.num_blocks} blocks free",
            "free must give every block of a finished or preempted request back to the free queue",
        )


CASES = [
    _ops_case(
        "allocate takes new blocks from the front of the free queue",
        8,
        4,
        [("allocate", "a", 6), ("allocate", "b", 1), ("allocate", "c", 0)],
        "pop blocks from the left of self.free_blocks, set each one's reference count to 1, extend the request's"
        " block table (self.block_tables) and record num_slots[request] = num_tokens; return the new blocks. A"
        " request with no tokens yet gets its table all the same, empty, and num_slots 0",
    ),
    _ops_case(
        "allocate adds only the blocks a request still lacks",
        8,
        4,
        [("allocate", "a", 3), ("allocate", "a", 4), ("allocate", "a", 9), ("allocate", "a", 2)],
        "self.blocks_needed(request_id, num_tokens) says how many blocks are missing; a table that already covers"
        " num_tokens gets nothing new (return []), and num_slots never shrinks",
    ),
    _ops_case(
        "allocate is all or nothing when blocks run out",
        4,
        4,
        [("allocate", "a", 8), ("allocate", "b", 12), ("allocate", "b", 8)],
        ALL_OR_NOTHING_HINT,
    ),
    _ops_case(
        "free gives every block back to the end of the free queue",
        4,
        2,
        [("allocate", "a", 5), ("allocate", "b", 2), ("free", "a"), ("allocate", "c", 2)],
        "decrement each block's reference count; a block that reaches 0 goes to the right end of"
        " self.free_blocks; drop the request from block_tables and num_slots; return the released blocks",
    ),
    _ops_case(
        "a block freed now is handed out after every block already free",
        4,
        2,
        [("allocate", "a", 4), ("free", "a"), ("allocate", "b", 2), ("allocate", "c", 6)],
        FREE_ORDER_HINT,
    ),
    _ops_case(  # one block: the free queue is empty when 'a' is freed, so only the KeyError can differ
        "free of a request that owns nothing raises KeyError",
        1,
        4,
        [("free", "x"), ("allocate", "a", 4), ("free", "a"), ("free", "a")],
        "a double free or an unknown request must raise KeyError, not pass silently or corrupt the queue",
    ),
    _ops_case(
        "a shared block stays in use until its last reference is freed",
        6,
        4,
        [("allocate", "a", 8), ("share", "a", "b"), ("allocate", "b", 6), ("free", "a"), ("free", "b")],
        "free returns a block to the queue only when its reference count drops to 0: another request may"
        " still reference it. Such a block gets a 'release' event, and the one whose count reaches 0 a 'free' one",
        events=True,
    ),
    _ops_case(
        "every allocation and free is recorded as a BlockEvent",
        4,
        2,
        [("step", 3), ("allocate", "a", 3), ("append_slot", "a"), ("step", 4), ("append_slot", "a"), ("free", "a")],
        "append BlockEvent('alloc', block, request_id, self.step) for each new block and"
        " BlockEvent('free', block, request_id, self.step) for each released one, with the allocator's current"
        " self.step (the scheduler sets it before each step): the block map draws them step by step",
        events=True,
    ),
    property_case(
        "random allocate/free/append_slot sequences behave like labkit's allocator",
        _strategy,
        _property,
    ),
    Case(
        "inside the engine, the allocator serves requests through preemptions and gets every block back",
        serves_in_the_engine,
        ENGINE_HINT,
    ),
]

EXERCISE = Exercise(
    number=1,
    after=("03",),
    slug="block_allocator",
    title="Block allocator",
    export="MyBlockAllocator",
    reference=lambda: BlockAllocator,
    cases=CASES,
    seams=("allocate", "free"),
)
