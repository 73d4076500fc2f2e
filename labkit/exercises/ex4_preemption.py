"""Checks for exercise 4, preemption: plan it (Scheduler.preempt), commit it (Scheduler.requeue_preempted).

The victim cases run one scenario, three requests decoding in a cache too small for all of them, until
the step that preempts, and then look at one part of the contract each; one plans that step and rolls it
back, as the engine does when the model fails; the other cases compare whole runs with labkit's scheduler
and with a run that never preempts.
"""

from __future__ import annotations

from typing import Any

from labkit.core.engine import Engine
from labkit.core.request import RequestState, SamplingParams
from labkit.core.scheduler import Scheduler
from labkit.core.sim import SimulatedModel
from labkit.exercises.engine_runs import (
    FIRST_DIFFERENCE_HINT,
    config,
    describe,
    listing_problem,
    lockstep,
    prompts,
    step_text,
)
from labkit.exercises.framework import Case, Exercise, Mismatch, property_case, showing

# Prompts of one block each, so the first decode needs a second block; three run (max_num_seqs), r3 waits.
SCENARIO = [(4, 12), (4, 12), (4, 12), (4, 12)]
SCENARIO_CONFIG = config(num_blocks=5, max_num_seqs=3)  # 3 blocks after prefill, 2 free: r2 is preempted
VICTIM = 2
# The same requests, four running: the first decode step preempts r3, then r2, and requeues r2 first.
TWO_VICTIMS_CONFIG = config(num_blocks=5, max_num_seqs=4)


def _scenario(cls: Any) -> tuple[Engine, str, list[tuple[Any, list[int]]]]:
    """A fresh engine on ``cls`` holding the scenario's requests, the scenario in words, and the list to which each
    preempt(output, victim) that returns adds (victim's id, the blocks it still holds then)."""
    engine = Engine(SimulatedModel(), SCENARIO_CONFIG, scheduler_cls=cls)
    for prompt in prompts(SCENARIO):
        engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    text = describe(SCENARIO_CONFIG, SCENARIO)
    showing(text)
    preempted: list[tuple[Any, list[int]]] = []
    preempt = engine.scheduler.preempt

    def watched(output: Any, victim: Any) -> None:
        preempt(output, victim)
        preempted.append((victim.request_id, list(engine.allocator.block_tables.get(victim.request_id, ()))))

    engine.scheduler.preempt = watched  # this engine's scheduler only: an instance attribute
    return engine, text, preempted


def _preempting_step(cls: Any) -> tuple[Engine, Any, dict[str, Any], str]:
    """Serve the scenario with ``cls`` until a step preempts; return the engine, that report and the state before.

    A step that calls preempt() on a victim and does not list it in output.preempted is a Mismatch at once: the
    victim stays in self.running without its blocks, and the next step that preempts it again raises KeyError.
    """
    engine, text, preempted = _scenario(cls)
    for _ in range(3):
        before = {"blocks": len(engine.allocator.block_tables.get(VICTIM, ())), "free": engine.num_free_blocks}
        called = len(preempted)
        report = engine.step()
        text += f"\nstep {report.step}: {step_text(report)}"
        showing(text)
        victims = [request_id for request_id, _ in preempted[called:]]
        problem = listing_problem(report.step, victims, list(report.preempted))
        if problem is not None:
            raise Mismatch(text, f"step {report.step}'s output.preempted lists {victims}", *problem)
        # each victim's blocks as preempt() returned: none, if it freed them then
        before["held after preempt"] = {request_id: blocks for request_id, blocks in reversed(preempted)}
        if report.preempted:
            return engine, report, before, text
    raise Mismatch(text, f"step 2 preempts r{VICTIM}", "no step preempted", _PLAN_HINT)


_PLAN_HINT = "preempt(output, victim) frees the victim's blocks and lists it: output.preempted.append(victim)"


def _victim_case(name: str, hint: str, check: Any) -> Case:
    def run(cls: Any) -> None:
        engine, report, before, text = _preempting_step(cls)
        problem = check(engine, report, before)
        if problem is not None:
            raise Mismatch(text, *problem, hint)

    return Case(name, run, hint)


def _listed(engine: Engine, report: Any, before: dict[str, Any]) -> tuple[str, str] | None:
    running = [r.request_id for r in engine.scheduler.running]
    if list(report.preempted) != [VICTIM] or running != [0, 1]:
        return f"preempted [{VICTIM}], running [0, 1]", f"preempted {list(report.preempted)}, running {running}"
    return None


def _blocks(engine: Engine, report: Any, before: dict[str, Any]) -> tuple[str, str] | None:
    kept, owns = before["held after preempt"].get(VICTIM), engine.allocator.block_tables.get(VICTIM)
    if kept and owns is None:  # freed later (in requeue_preempted, say): too late for the request needing a block
        return (
            f"r{VICTIM} owns no blocks once preempt(output, r{VICTIM}) returns",
            f"r{VICTIM} still owned {len(kept)} block{'s' * (len(kept) != 1)} (ids {kept}) when preempt returned",
        )
    if owns is not None:
        return (
            f"r{VICTIM} owns no blocks",
            f"r{VICTIM} still owns {len(owns)} block{'s' * (len(owns) != 1)}: ids {owns}",
        )
    return None


def _computed(engine: Engine, report: Any, before: dict[str, Any]) -> tuple[str, str] | None:
    request = engine.requests[VICTIM]
    if request.num_computed_tokens != 0 or request.state is not RequestState.WAITING:
        return (
            f"r{VICTIM}.num_computed_tokens == 0 and state RequestState.WAITING",
            f"r{VICTIM}.num_computed_tokens == {request.num_computed_tokens} and state {request.state}",
        )
    return None


def _requeued(engine: Engine, report: Any, before: dict[str, Any]) -> tuple[str, str] | None:
    waiting = [r.request_id for r in engine.scheduler.waiting]
    if waiting[:1] != [VICTIM]:
        return f"r{VICTIM} first in the waiting queue", f"waiting is {waiting}"
    return None


def _counted(engine: Engine, report: Any, before: dict[str, Any]) -> tuple[str, str] | None:
    count = engine.requests[VICTIM].metrics.num_preemptions
    if count != 1:
        return f"r{VICTIM}.metrics.num_preemptions == 1", f"num_preemptions == {count}"
    return None


def _victim_state(engine: Engine) -> str:
    scheduler, victim = engine.scheduler, engine.requests[VICTIM]
    return (
        f"r{VICTIM}: state {victim.state}, num_computed_tokens {victim.num_computed_tokens},"
        f" num_preemptions {victim.metrics.num_preemptions}; running {[r.request_id for r in scheduler.running]},"
        f" waiting {[r.request_id for r in scheduler.waiting]}"
    )


_ROLLBACK_HINT = (
    "preempt() only plans: free the victim's blocks (the allocator's checkpoint can undo that) and list it in"
    " output.preempted, nothing more. Its state, num_computed_tokens and num_preemptions change in"
    " requeue_preempted(), which update() calls once the model has run: a step that fails is rolled back, and"
    " only the allocator's changes are undone"
)


def _rolled_back(cls: Any) -> None:
    """Plan the preempting step, then roll it back as the engine does when the model fails: r2 must be as before."""
    engine, text, preempted = _scenario(cls)
    report = engine.step()
    text += f"\nstep {report.step}: {step_text(report)}"
    before = _victim_state(engine)
    text += "\nstep 2 is planned (output = scheduler.schedule()), then the model fails and the engine rolls it"
    text += " back (scheduler.rollback(output))"
    showing(text)
    output = engine.scheduler.schedule()
    engine.scheduler.rollback(output)
    listed = [r.request_id for r in output.preempted]
    if listed != [VICTIM]:
        problem = listing_problem(output.step, [request_id for request_id, _ in preempted], listed)
        got, hint = problem or (f"the plan preempts {listed}", _PLAN_HINT)
        raise Mismatch(text, f"the plan preempts [{VICTIM}]", got, hint)
    after = _victim_state(engine)
    if after != before:
        raise Mismatch(text, f"as before the plan: {before}", f"after the rollback: {after}", _ROLLBACK_HINT)


def _unchanged_output(cls: Any) -> None:
    workload = [(10, 16), (9, 16), (11, 16), (8, 16)]
    cfg = config(num_blocks=14, max_batch_tokens=24)
    hint = (
        "a recomputed request must end up with exactly the tokens it would have had without preemption: keep"
        " victim.output_token_ids, so that it recomputes its prompt and those tokens (request.num_tokens) and"
        " goes on from there"
    )
    lockstep(cls, cfg, workload, hint)
    tight = Engine(SimulatedModel(), cfg, scheduler_cls=cls)
    roomy = Engine(SimulatedModel(), config(num_blocks=64, max_batch_tokens=24))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in workload]
    squeezed, free = tight.generate(prompts(workload), params), roomy.generate(prompts(workload), params)
    for a, b in zip(squeezed, free, strict=True):
        if a.output_token_ids != b.output_token_ids:
            raise Mismatch(describe(cfg, workload), repr(b.output_token_ids), repr(a.output_token_ids), hint)


TWO_VICTIMS_HINT = (
    "two victims of one step wait again oldest first: preempt() lists each victim as it comes"
    " (output.preempted.append(victim)), the youngest first, and requeue_preempted() puts each one at the front of"
    " the waiting queue (self.waiting.appendleft(victim)), so the last one requeued, the oldest, runs first"
)


def _strategy() -> Any:
    from hypothesis import strategies as st

    request = st.tuples(st.integers(1, 12), st.integers(1, 14))
    return st.tuples(st.lists(request, min_size=1, max_size=5), st.integers(6, 16), st.booleans())


def _property(cls: Any, example: Any) -> None:
    workload, blocks, chunked = example
    cfg = config(num_blocks=blocks, max_batch_tokens=32, chunked_prefill=chunked)
    workload = [(p, n) for p, n in workload if p + n - 1 <= blocks * cfg.block_size] or [(1, 1)]
    lockstep(cls, cfg, workload, FIRST_DIFFERENCE_HINT.format("scheduler"))


CASES = [
    _victim_case(
        "the plan lists the victim in output.preempted",
        f"{_PLAN_HINT}; update() then takes the listed victims off the end of self.running",
        _listed,
    ),
    _victim_case(
        "the victim's blocks all go back to the free queue",
        "in preempt(), self.allocator.free(victim.request_id): a preempted request keeps no blocks, that is"
        " the point of preempting it; and it gives them back in preempt() itself, not later in"
        " requeue_preempted(), so that the running request that needed a block gets one in this very step",
        _blocks,
    ),
    _victim_case(
        "the victim's computed tokens restart at 0 and it waits again",
        "its keys and values went with its blocks: in requeue_preempted(), set victim.num_computed_tokens = 0"
        " and victim.state = RequestState.WAITING, so it is recomputed from its prompt and its output so far",
        _computed,
    ),
    _victim_case(
        "the victim goes to the front of the waiting queue",
        "self.waiting.appendleft(victim): a preempted request runs again before newer arrivals",
        _requeued,
    ),
    _victim_case(
        "the victim's preemption is counted in its metrics",
        "victim.metrics.num_preemptions += 1: serving dashboards (and labkit's metrics) count preemptions",
        _counted,
    ),
    Case("a rolled-back step leaves its victim as it was", _rolled_back, _ROLLBACK_HINT),
    Case(
        "two victims of one step are listed in the order they were preempted",
        lambda cls: lockstep(cls, TWO_VICTIMS_CONFIG, SCENARIO, TWO_VICTIMS_HINT),
        TWO_VICTIMS_HINT,
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
    after=("06",),
    slug="preemption",
    title="Preemption",
    export="MyScheduler",
    reference=lambda: Scheduler,
    cases=CASES,
    seams=("preempt", "requeue_preempted"),
)
