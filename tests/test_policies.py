"""Scheduling policies beyond first come, first served: priority and shortest-first, on hand-worked runs.

The random runs of every policy are in test_scheduler.py (no caching) and test_prefix_cache.py (caching).
"""

import pytest

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.core.blocks import BlockAllocator
from labkit.core.queues import AGEING, FcfsQueue, PriorityQueue, ShortestFirstQueue
from labkit.core.request import Request
from labkit.core.scheduler import Scheduler
from tests.test_scheduler import commit_step, run_to_completion


def engine_for(scheduling: str, **kwargs) -> Engine:
    config = dict(block_size=4, num_blocks=64, max_batch_tokens=64, max_num_seqs=2) | kwargs
    return Engine(SimulatedModel(), EngineConfig(scheduling=scheduling, **config))


@pytest.mark.parametrize(
    ("scheduling", "expected"),
    [("fcfs", [0, 1, 2, 3]), ("priority", [2, 0, 3, 1]), ("shortest-first", [3, 1, 2, 0])],
)
def test_each_policy_admits_in_its_own_order(scheduling, expected):
    # One seat: the admission order is the policy's order. Prompt + max_new_tokens: 30, 12, 20, 6;
    # priorities: 1, 2, 0, 1 (ties by arrival).
    engine = engine_for(scheduling, max_num_seqs=1)
    requests = [(20, 10, 1), (8, 4, 2), (10, 10, 0), (4, 2, 1)]
    for prompt_len, max_new_tokens, priority in requests:
        engine.add_request([5] * prompt_len, SamplingParams(max_new_tokens=max_new_tokens, priority=priority))
    order = [rid for report in run_to_completion(engine) for rid in report.admitted]
    assert order == expected


def test_priority_a_better_request_arriving_into_a_full_engine_starts_in_the_next_step():
    # Two seats, both taken by low-priority requests that decode for a long time.
    engine = engine_for("priority")
    low = [engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=30, priority=5)) for _ in range(2)]
    for _ in range(3):
        engine.step()
    high = engine.add_request([8, 9], SamplingParams(max_new_tokens=3, priority=0))
    report = engine.step()
    assert report.admitted == [high] and report.preempted == [low[1]]  # the later of the two equals
    assert high in {w.request_id for w in report.scheduled}
    assert low[0] in {w.request_id for w in report.scheduled}  # the other keeps running beside it
    run_to_completion(engine)
    assert [engine.requests[r].finish_reason for r in (*low, high)] == ["length"] * 3


def test_priority_a_better_request_takes_the_blocks_it_needs_from_worse_ones():
    # Seats to spare but no free block: the lowest-ranked running request gives its blocks up.
    engine = engine_for("priority", num_blocks=4, max_num_seqs=4)
    mid = engine.add_request([5] * 4, SamplingParams(max_new_tokens=4, priority=1))
    low = engine.add_request([6] * 8, SamplingParams(max_new_tokens=4, priority=2))
    engine.step()
    assert engine.num_free_blocks == 1
    high = engine.add_request([7] * 8, SamplingParams(max_new_tokens=2, priority=0))
    report = engine.step()
    assert report.preempted == [low] and report.admitted == [high]
    assert {w.request_id for w in report.scheduled} == {mid, high}
    run_to_completion(engine)
    assert engine.requests[low].finish_reason == "length" and engine.requests[low].metrics.num_preemptions == 1
    assert engine.scheduler.waiting._keys == {}  # a finished request's key is forgotten


def test_priority_a_newcomer_never_takes_the_blocks_of_a_request_that_outranks_it():
    # A full cache: high (priority 0) is halfway through its prompt, two worse ones (2) hold the rest.
    engine = engine_for("priority", block_size=2, num_blocks=7, max_batch_tokens=8, max_num_seqs=8)
    worse = [engine.add_request(p, SamplingParams(max_new_tokens=8, priority=2)) for p in ([7, 8], [7, 9, 9, 9])]
    engine.step()
    high = engine.add_request(list(range(2, 14)), SamplingParams(max_new_tokens=2, priority=0))
    engine.step()
    assert engine.num_free_blocks == 0
    middle = engine.add_request([20, 21, 22], SamplingParams(max_new_tokens=2, priority=1))
    report = engine.step()
    assert high not in report.preempted and high in {w.request_id for w in report.scheduled}  # its prompt goes on
    assert set(report.preempted) <= set(worse) and middle not in report.preempted
    run_to_completion(engine)
    assert engine.requests[high].metrics.num_preemptions == 0


def test_priority_a_newcomer_never_takes_the_budget_of_a_request_that_outranks_it():
    engine = engine_for("priority", num_blocks=16, max_batch_tokens=4, max_num_seqs=4)
    high = engine.add_request([5, 6], SamplingParams(max_new_tokens=8, priority=0))
    engine.add_request([7, 8], SamplingParams(max_new_tokens=8, priority=2))
    engine.step()
    middle = engine.add_request(list(range(2, 12)), SamplingParams(max_new_tokens=2, priority=1))
    report = engine.step()
    assert report.admitted == [middle]
    assert [w.request_id for w in report.scheduled] == [high, middle]  # the better decode first, then its chunk


def test_priority_displaces_no_one_for_a_newcomer_that_could_not_start_anyway():
    # No free block: high holds four, low one. The newcomer needs three; displacing low would free only one.
    engine = engine_for("priority", num_blocks=5, max_batch_tokens=32, max_num_seqs=4)
    high = engine.add_request(list(range(2, 17)), SamplingParams(max_new_tokens=2, priority=0))  # 15 tokens
    low = engine.add_request([5, 6], SamplingParams(max_new_tokens=2, priority=2))
    engine.step()
    assert engine.num_free_blocks == 0
    engine.add_request(list(range(20, 32)), SamplingParams(max_new_tokens=2, priority=1))  # 12 tokens
    report = engine.step()
    assert report.preempted == [] and report.admitted == []
    assert {w.request_id for w in report.scheduled} == {high, low}  # both go on, each within its last block


def test_priority_with_prefix_caching_displaces_no_one_whose_blocks_the_newcomer_would_share_anyway():
    # No free block: middle (priority 0) and low (5) hold three each; low's first two are a cached prefix.
    # The newcomer (0, after middle) starts with that prefix and needs two more blocks. Displacing low frees
    # three, but two of them are the prefix it would take back: one is left, so low is not displaced in vain.
    engine = engine_for("priority", num_blocks=6, max_num_seqs=4, enable_prefix_caching=True)
    shared = list(range(10, 18))
    middle = engine.add_request(list(range(30, 39)), SamplingParams(max_new_tokens=10, priority=0))
    low = engine.add_request([*shared, 9], SamplingParams(max_new_tokens=10, priority=5))
    engine.step()
    assert engine.num_free_blocks == 0 and engine.num_cached_blocks >= 2
    newcomer = engine.add_request([*shared, 40, 41, 42, 43, 44], SamplingParams(max_new_tokens=2, priority=0))
    report = engine.step()
    assert report.preempted == [] and report.admitted == []
    assert {w.request_id for w in report.scheduled} == {middle, low}
    run_to_completion(engine)
    assert [engine.requests[r].finish_reason for r in (middle, low, newcomer)] == ["length"] * 3


def test_priority_with_prefix_caching_counts_only_the_uncached_tokens_of_a_better_request():
    # Without chunked prefill a request must compute its prompt in one step. The second better request's
    # prompt (14 tokens) is longer than the budget the first leaves (8), but 12 of them are cached: it
    # displaces the last worse request now instead of waiting a step for budget it does not need.
    engine = engine_for("priority", max_batch_tokens=16, chunked_prefill=False, enable_prefix_caching=True)
    shared = list(range(10, 22))
    engine.generate([shared], SamplingParams(max_new_tokens=2))
    low = [engine.add_request([5, 6], SamplingParams(max_new_tokens=15, priority=5)) for _ in range(2)]
    engine.step()
    first = engine.add_request([8] * 8, SamplingParams(max_new_tokens=2))
    second = engine.add_request([*shared, 7, 7], SamplingParams(max_new_tokens=2))
    report = engine.step()
    assert report.admitted == [first, second] and report.preempted == [low[1], low[0]]
    assert {w.request_id: w.num_tokens for w in report.scheduled} == {first: 8, second: 2}
    run_to_completion(engine)
    assert [engine.requests[r].finish_reason for r in (*low, first, second)] == ["length"] * 4


def test_priority_never_displaces_an_equal_or_better_request():
    engine = engine_for("priority")
    first = [engine.add_request([5, 6], SamplingParams(max_new_tokens=10, priority=1)) for _ in range(2)]
    engine.step()
    engine.add_request([7, 8], SamplingParams(max_new_tokens=2, priority=1))
    reports = [engine.step() for _ in range(5)]
    assert all(r.preempted == [] for r in reports)
    assert all(set(first) <= {w.request_id for w in r.scheduled} for r in reports)


def starve(ageing: float, steps: int) -> tuple[Engine, int, int | None]:
    """Shortest-first under a steady stream of short requests (one per step), with one long request waiting.

    Returns the engine, the long request's id and the step it finished at (None if it has not within ``steps``).
    """
    engine = engine_for("shortest-first", max_num_seqs=1)
    engine.scheduler.waiting = ShortestFirstQueue(ageing=ageing)
    short = SamplingParams(max_new_tokens=2)
    engine.add_request([5] * 2, short)  # expects 4 tokens
    long_id = engine.add_request([6] * 10, SamplingParams(max_new_tokens=6))  # expects 16 tokens
    for step in range(1, steps + 1):
        engine.add_request([7] * 2, short)
        report = engine.step()
        if long_id in report.finished:
            return engine, long_id, step
    return engine, long_id, None


def test_shortest_first_ageing_bounds_how_long_a_long_request_waits():
    # Keys: expected tokens + AGEING x arrival step. The long request (16 tokens, arriving at step 0) ranks
    # before every short one (4 tokens) arriving after step (16 - 4) / AGEING; the ones before it and the
    # short one it arrived with run first, 2 steps each (one seat: prefill + 1 decode), then it runs for
    # 6 steps (prefill + 5 decodes).
    passing = 1 + int((16 - 4) // AGEING)  # short arrivals at steps 1 .. (16 - 4) // AGEING
    bound = 2 * (1 + passing) + 6
    _, _, finished = starve(AGEING, steps=200)
    assert finished is not None and finished <= bound
    # Without ageing the long request waits forever behind the stream.
    _, _, finished = starve(0, steps=200)
    assert finished is None


def test_priority_without_chunked_prefill_displaces_no_one_for_a_prompt_the_budget_left_cannot_hold():
    # Without chunked prefill a prompt is computed in one step. The better running request decodes first and
    # leaves 15 of the 16 tokens; the newcomer's 16-token prompt cannot start this step whatever it displaces,
    # so low keeps running (displacing it would only make it compute its tokens again).
    engine = engine_for("priority", max_batch_tokens=16, chunked_prefill=False)
    top = engine.add_request([5, 6], SamplingParams(max_new_tokens=10, priority=0))
    low = engine.add_request([7, 8], SamplingParams(max_new_tokens=10, priority=5))
    engine.step()
    newcomer = engine.add_request(list(range(2, 18)), SamplingParams(max_new_tokens=1, priority=1))
    report = engine.step()
    assert report.preempted == [] and report.admitted == []
    assert {w.request_id for w in report.scheduled} == {top, low}
    run_to_completion(engine)
    assert [engine.requests[r].finish_reason for r in (top, low, newcomer)] == ["length"] * 3
    assert engine.requests[low].metrics.num_preemptions == 0


def test_the_fcfs_queue_can_be_used_as_a_deque():
    # The exercises treat the waiting queue as a deque: append puts a request last, appendleft first.
    queue = FcfsQueue()
    a, b, c = (Request(i, [5, 6], SamplingParams()) for i in range(3))
    queue.add(a, step=0)
    queue.append(b)
    queue.appendleft(c)
    assert list(queue) == [c, a, b] and len(queue) == 3
    assert queue.popleft() is c and list(queue) == [a, b]


def test_priority_a_request_preempted_for_room_is_not_displaced_again_for_a_newcomer():
    # Block size 2, four blocks: A (priority 0) and B (5) hold two each. At step 4 A needs a third block:
    # B is preempted for room. H (1) outranks B but not A: it must not be admitted in that step on B's account.
    engine = engine_for("priority", block_size=2, num_blocks=4, max_num_seqs=4)
    a = engine.add_request([5, 6], SamplingParams(max_new_tokens=6, priority=0))
    b = engine.add_request([7, 8], SamplingParams(max_new_tokens=6, priority=5))
    for _ in range(3):
        engine.step()
    assert engine.num_free_blocks == 0
    h = engine.add_request([9], SamplingParams(max_new_tokens=2, priority=1))
    report = engine.step()
    assert report.preempted == [b] and report.admitted == []
    assert [w.request_id for w in report.scheduled] == [a]
    run_to_completion(engine)
    assert [engine.requests[r].finish_reason for r in (a, b, h)] == ["length"] * 3


def priority_scheduler(**settings: object) -> Scheduler:
    """A Scheduler under "priority" with its own allocator: planned and committed by hand, no engine."""
    config = EngineConfig(scheduling="priority", **settings)
    allocator = BlockAllocator(config.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching)
    return Scheduler(config, allocator)


def test_priority_ties_break_by_arrival_even_after_a_requeue():
    queue = PriorityQueue()
    a, b = (Request(i, [5, 6], SamplingParams(priority=1)) for i in range(2))
    queue.add(a, 0)
    queue.add(b, 0)
    assert queue.popleft() is a
    queue.requeue(a)  # preempted: back ahead of the later arrival of equal priority
    assert list(queue) == [a, b]
    assert queue.outranks(a, b) and not queue.outranks(b, a)


def test_ranked_queue_popleft_takes_the_smallest_key():
    queue = PriorityQueue()
    low, high = Request(0, [5], SamplingParams(priority=2)), Request(1, [5], SamplingParams(priority=0))
    queue.add(low, 0)
    queue.add(high, 0)
    assert queue.popleft() is high


def test_shortest_first_counts_max_new_tokens():
    queue = ShortestFirstQueue()
    long_output = Request(0, [5] * 4, SamplingParams(max_new_tokens=100))  # 104 expected tokens
    long_prompt = Request(1, [5] * 20, SamplingParams(max_new_tokens=1))  # 21 expected tokens
    queue.add(long_output, 0)
    queue.add(long_prompt, 0)
    assert list(queue) == [long_prompt, long_output]


@pytest.mark.parametrize(
    "settings",
    [{"max_batch_tokens": 16}, {"max_batch_tokens": 8, "chunked_prefill": False}],
    ids=["victims-free-exactly-the-blocks", "unchunked-prompt-exactly-the-budget"],
)
def test_priority_displaces_at_the_exact_limit(settings):
    """The better request needs exactly the two blocks its victim holds (and, unchunked, exactly the budget)."""
    scheduler = priority_scheduler(block_size=4, num_blocks=2, max_num_seqs=4, **settings)
    low = Request(0, [1] * 5, SamplingParams(max_new_tokens=4, priority=2))
    scheduler.add(low)
    commit_step(scheduler)  # low holds both blocks
    high = Request(1, [2] * 8, SamplingParams(max_new_tokens=1, priority=0))  # 8 tokens: both blocks
    scheduler.add(high)
    out = commit_step(scheduler)
    assert out.preempted == [low] and out.admitted == [high]


def test_priority_does_not_displace_a_request_whose_blocks_are_shared_with_a_better_one():
    scheduler = priority_scheduler(
        block_size=4, num_blocks=4, max_batch_tokens=32, max_num_seqs=4, enable_prefix_caching=True
    )
    shared = list(range(10, 18))
    a = Request(0, [*shared, 1], SamplingParams(max_new_tokens=4, priority=0))
    scheduler.add(a)
    commit_step(scheduler)  # a: blocks 0, 1 (indexed), 2
    b = Request(1, [*shared, 2], SamplingParams(max_new_tokens=4, priority=2))
    scheduler.add(b)
    commit_step(scheduler)  # b shares blocks 0, 1 and takes block 3: nothing free
    high = Request(2, [3] * 5, SamplingParams(max_new_tokens=2, priority=1))  # needs 2 blocks; b frees only 1
    scheduler.add(high)
    out = commit_step(scheduler)
    assert out.preempted == [] and out.admitted == []


def test_a_failed_steps_victim_does_not_run_after_a_displacement_that_preempted_no_one():
    scheduler = priority_scheduler(block_size=4, num_blocks=16, max_batch_tokens=32, max_num_seqs=3)
    a, m, b = (Request(i, [i + 1] * 3, SamplingParams(max_new_tokens=8, priority=p)) for i, p in enumerate((0, 3, 5)))
    for r in (a, m, b):
        scheduler.add(r)
    commit_step(scheduler)
    h = Request(3, [9] * 3, SamplingParams(max_new_tokens=2, priority=1))
    scheduler.add(h)
    failed = scheduler.schedule()
    assert failed.preempted == [b] and failed.admitted == [h]  # no seat: h displaces b
    scheduler.rollback(failed)  # the step failed; b must still be evicted first
    scheduler.abort(a.request_id, 0.0)  # a seat frees up: h is admitted without displacing anyone
    out = scheduler.schedule()
    assert out.admitted == [h]
    assert out.preempted == [b] and b not in [c.request for c in out.chunks]
