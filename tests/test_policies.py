"""Scheduling policies beyond first come, first served: priority and shortest-first, on hand-worked runs.

The random runs of every policy are in test_scheduler.py (no caching) and test_prefix_cache.py (caching).
"""

import pytest

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.core.queues import AGEING, FcfsQueue, ShortestFirstQueue
from labkit.core.request import Request
from tests.test_scheduler import run_to_completion


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
