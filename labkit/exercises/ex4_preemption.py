"""Checks for exercise 4, preemption (Scheduler.preempt_one): evict, free, requeue, recompute unchanged."""

from __future__ import annotations

from typing import Any

from labkit.core.engine import Engine
from labkit.core.request import RequestState, SamplingParams
from labkit.core.scheduler import Scheduler, SchedulerOutput
from labkit.core.sim import SimulatedModel
from labkit.exercises.engine_runs import config, describe, lockstep, prompts
from labkit.exercises.framework import Case, Exercise, Mismatch, property_case

SCENARIO = [(6, 12), (5, 12), (7, 12)]  # three running requests, in admission order r0, r1, r2


def _after_one_preemption(cls: Any) -> tuple[Engine, Any, Any, str]:
    """Three requests admitted and decoding, one more waiting; then the learner's preempt_one, called once."""
    cfg = config(num_blocks=32)
    engine = Engine(SimulatedModel(), cfg, scheduler_cls=cls)
    for prompt in prompts([*SCENARIO, (4, 2)]):
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine.scheduler.config = config(num_blocks=32, max_num_seqs=3)  # r3 stays waiting
    for _ in range(3):
        engine.step()
    scheduler = engine.scheduler
    output = SchedulerOutput(step=scheduler.step_index, chunks=[])
    before = {
        "running": [r.request_id for r in scheduler.running],
        "waiting": [r.request_id for r in scheduler.waiting],
        "free": engine.allocator.num_free_blocks,
        "blocks": {r.request_id: len(engine.allocator.block_tables[r.request_id]) for r in scheduler.running},
    }
    text = (
        "three requests r0, r1, r2 admitted in that order and decoding, r3 waiting;"
        f" running {before['running']}, waiting {before['waiting']}, {before['free']} free blocks\n"
        "victim = scheduler.preempt_one(output)"
    )
    victim = scheduler.preempt_one(output)
    return engine, output, victim, text, before  # type: ignore[return-value]


def _victim_case(name: str, hint: str, check: Any) -> Case:
    def run(cls: Any) -> None:
        engine, output, victim, text, before = _after_one_preemption(cls)
        problem = check(engine, output, victim, before)
        if problem is not None:
            expected, got = problem
            raise Mismatch(text, expected, got, hint)

    return Case(name, run, hint)


def _victim(engine: Engine, output: Any, victim: Any, before: Any) -> tuple[str, str] | None:
    want = before["running"][-1]
    got = getattr(victim, "request_id", victim)
    if got != want:
        return f"returns r{want}, the most recently admitted running request", f"returns {victim!r}"
    running = [r.request_id for r in engine.scheduler.running]
    if running != before["running"][:-1]:
        return f"running becomes {before['running'][:-1]}", f"running is {running}"
    return None


def _blocks(engine: Engine, output: Any, victim: Any, before: Any) -> tuple[str, str] | None:
    rid = before["running"][-1]
    free = engine.allocator.num_free_blocks
    want = before["free"] + before["blocks"][rid]
    if rid in engine.allocator.block_tables or free != want:
        owns = engine.allocator.block_tables.get(rid)
        return (
            f"r{rid} owns no blocks; {want} blocks free",
            f"r{rid} owns {owns if owns is not None else 'no blocks'}; {free} blocks free",
        )
    return None


def _computed(engine: Engine, output: Any, victim: Any, before: Any) -> tuple[str, str] | None:
    request = engine.requests[before["running"][-1]]
    if request.num_computed_tokens != 0 or request.state is not RequestState.WAITING:
        return (
            "num_computed_tokens == 0 and state RequestState.WAITING",
            f"num_computed_tokens == {request.num_computed_tokens} and state {request.state}",
        )
    return None


def _requeued(engine: Engine, output: Any, victim: Any, before: Any) -> tuple[str, str] | None:
    waiting = [r.request_id for r in engine.scheduler.waiting]
    want = [before["running"][-1], *before["waiting"]]
    if waiting != want:
        return f"waiting is {want}", f"waiting is {waiting}"
    return None


def _recorded(engine: Engine, output: Any, victim: Any, before: Any) -> tuple[str, str] | None:
    rid = before["running"][-1]
    listed = [r.request_id for r in output.preempted]
    count = engine.requests[rid].metrics.num_preemptions
    if listed != [rid] or count != 1:
        return f"output.preempted == [r{rid}] and its metrics.num_preemptions == 1", (
            f"output.preempted == {listed} and num_preemptions == {count}"
        )
    return None


def _unchanged_output(cls: Any) -> None:
    workload = [(10, 16), (9, 16), (11, 16), (8, 16)]
    cfg = config(num_blocks=14, max_batch_tokens=24)
    hint = "a recomputed request must end up with exactly the tokens it would have had without preemption"
    lockstep(cls, cfg, workload, hint)
    tight = Engine(SimulatedModel(), cfg, scheduler_cls=cls)
    roomy = Engine(SimulatedModel(), config(num_blocks=64, max_batch_tokens=24))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in workload]
    squeezed, free = tight.generate(prompts(workload), params), roomy.generate(prompts(workload), params)
    for a, b in zip(squeezed, free, strict=True):
        if a.output_token_ids != b.output_token_ids:
            raise Mismatch(describe(cfg, workload), repr(b.output_token_ids), repr(a.output_token_ids), hint)


def _strategy() -> Any:
    from hypothesis import strategies as st

    request = st.tuples(st.integers(1, 12), st.integers(1, 14))
    return st.tuples(st.lists(request, min_size=1, max_size=5), st.integers(6, 16), st.booleans())


def _property(cls: Any, example: Any) -> None:
    workload, blocks, chunked = example
    cfg = config(num_blocks=blocks, max_batch_tokens=32, chunked_prefill=chunked)
    workload = [(p, n) for p, n in workload if p + n - 1 <= blocks * cfg.block_size] or [(1, 1)]
    lockstep(cls, cfg, workload, "the step above is the first one that differs from labkit's scheduler")


CASES = [
    _victim_case(
        "the victim is the most recently admitted running request",
        "self.running is in admission order: the victim is its last entry (self.running.pop())",
        _victim,
    ),
    _victim_case(
        "the victim's blocks all go back to the free queue",
        "call self.allocator.free(request.request_id): a preempted request keeps no blocks",
        _blocks,
    ),
    _victim_case(
        "the victim's computed tokens restart at 0 and it waits again",
        "its keys and values are gone with its blocks: set request.num_computed_tokens = 0 and"
        " request.state = RequestState.WAITING, so it is recomputed from its prompt and its output so far",
        _computed,
    ),
    _victim_case(
        "the victim goes to the front of the waiting queue",
        "self.waiting.appendleft(request): a preempted request runs again before newer arrivals",
        _requeued,
    ),
    _victim_case(
        "the victim is listed in output.preempted and counted in its metrics",
        "output.preempted.append(request) and request.metrics.num_preemptions += 1: the step report shows them",
        _recorded,
    ),
    Case(
        "a preempted request's output is unchanged",
        _unchanged_output,
        "a recomputed request must end up with exactly the tokens it would have had without preemption",
    ),
    property_case("random workloads on a small cache preempt like labkit", _strategy, _property, max_examples=40),
]

EXERCISE = Exercise(
    number=4,
    slug="preemption",
    title="Preemption",
    export="MyScheduler",
    reference=lambda: Scheduler,
    cases=CASES,
)
