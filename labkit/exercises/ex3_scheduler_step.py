"""Checks for exercise 3, a continuous-batching step within a token budget (Scheduler.schedule_continuous)."""

from __future__ import annotations

from typing import Any

from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.report import StepReport
from labkit.core.scheduler import Scheduler
from labkit.exercises.engine_runs import (
    FIRST_CHUNK_RULE,
    FIRST_DIFFERENCE_HINT,
    Workload,
    budget_rule,
    config,
    describe,
    engines,
    lockstep,
    max_seqs_rule,
    planned,
    run_in_lockstep,
)
from labkit.exercises.framework import Case, Exercise, Mismatch, property_case, showing

BUDGET_HINT = (
    "keep a budget = max_batch_tokens, give each chunk min(remaining tokens, budget) and subtract it;"
    " stop when the budget reaches 0"
)
SEQS_HINT = "admit only while len(self.running) + len(output.admitted) < self.config.max_num_seqs"
ORDER_HINT = (
    "first walk self.running in order (each gets its next decode token or prompt chunk), and only then"
    " admit from self.waiting: a running request is never starved by a newcomer"
)
RECOMPUTE_HINT = (
    "a preempted request waits again at the front of self.waiting and recomputes all its request.num_tokens"
    " (its prompt and the tokens it generated) from 0: admit it with min(request.num_tokens, budget) tokens,"
    " not just its prompt"
)
PREFILL_CHUNK_HINT = (
    "a chunk is a prefill while its request is PREFILLING (output.add_chunk(request, start, n, request.state is"
    " RequestState.PREFILLING)): also a prompt's last chunk of a single token, and also a recomputed request's"
    " chunks past its prompt (a preempted request recomputes the tokens it generated too)"
)
#: Prefill chunks that a label by the chunk's length, or by the prompt's end, calls decodes: (workload, config).
PREFILL_CHUNKS = {
    # a 13-token prompt under a budget of 12 ends with a chunk of one token
    "a prompt's last chunk of one token is still a prefill": ([(13, 3)], {"max_batch_tokens": 12}),
    # r1 is preempted after generating 2 tokens, then recomputes 9 tokens in two chunks, the second past its prompt
    "a request recomputed after preemption prefills all its tokens, chunk by chunk": (
        [(2, 5), (7, 4)],
        {"max_batch_tokens": 9, "num_blocks": 4},
    ),
}
NO_ADMIT_HINT = (
    "a step that preempts admits nothing new: if output.preempted is not empty after the running requests,"
    " skip admission, also when no request needed a block and the victims are only self.evict_first's. The"
    " victim's blocks went back so that the running requests can grow, and the victim waits first in line again;"
    " handing its blocks to a newcomer would evict one request to admit another"
)

EVICT_FIRST_HINT = (
    "a step that failed after planning a preemption may already have written other requests' keys and values"
    " into its victims' blocks, so they must be recomputed before they run again: self.evict_first lists them,"
    " and those not finished since are the last of self.running. Walk only the running requests before them,"
    " then preempt each of them (self.preempt) and admit nothing in that step"
)
EVICT_FINISHED_HINT = (
    "self.evict_first still lists a victim that finished after the rollback (aborted, here): it has left"
    " self.running, so it is not one of its last requests any more. Count only the listed requests not finished"
    " since ([r for r in self.evict_first if r.state is not RequestState.FINISHED]); preempting as many of the"
    " last running requests as self.evict_first lists evicts a request that the failed step never preempted"
)


def decode_first_rule(engine: Engine, report: StepReport, cfg: EngineConfig) -> str | None:
    admitted = set(report.admitted)
    seen_new = None
    for work in report.scheduled:
        if work.request_id in admitted:
            seen_new = work.request_id
        elif seen_new is not None:
            return f"step {report.step} schedules newly admitted r{seen_new} before running r{work.request_id}"
    return None


def no_admit_rule(engine: Engine, report: StepReport, cfg: EngineConfig) -> str | None:
    if report.preempted and report.admitted:
        return f"step {report.step} preempts {list(report.preempted)} and admits {list(report.admitted)}"
    return None


RULES = [
    (budget_rule, BUDGET_HINT),
    (max_seqs_rule, SEQS_HINT),
    (decode_first_rule, ORDER_HINT),
    (no_admit_rule, NO_ADMIT_HINT),
]


def _case(name: str, workload: Workload, hint: str, **overrides: Any) -> Case:
    cfg = config(**overrides)
    return Case(name, lambda cls: lockstep(cls, cfg, workload, hint, RULES), hint)


def _strategy() -> Any:
    from hypothesis import strategies as st

    request = st.tuples(st.integers(1, 20), st.integers(1, 10))
    return st.tuples(
        st.lists(request, min_size=1, max_size=6),
        st.integers(4, 24),  # max_batch_tokens
        st.integers(1, 4),  # max_num_seqs
        st.integers(12, 40),  # num_blocks
        st.booleans(),  # chunked_prefill
    )


def _property(cls: Any, example: Any) -> None:
    workload, budget, seqs, blocks, chunked = example
    if not chunked:  # without chunking, every request must be computable in one step
        workload = [(min(p, budget - n + 1), n) for p, n in workload if n <= budget]
        workload = [(p, n) for p, n in workload if p >= 1] or [(1, 1)]
    cfg = config(max_batch_tokens=budget, max_num_seqs=min(seqs, budget), num_blocks=blocks, chunked_prefill=chunked)
    lockstep(cls, cfg, workload, FIRST_DIFFERENCE_HINT.format("scheduler"), RULES)


def _after_a_failed_step(
    cls: Any, workload: Workload, cfg: EngineConfig, aborted: int, hint: str, why: str = ""
) -> None:
    """Serve ``workload`` in lockstep until the step that first preempts (r2), which fails in the model and is rolled
    back; then request ``aborted`` is aborted, and both schedulers serve the rest in lockstep, ``hint`` at a
    difference. ``why`` says, after the setup, what the aborted request leaves behind."""
    probe = engines(Scheduler, cfg, workload)[1]
    while not (report := probe.step()).preempted:
        pass
    failing = report.step
    mine, ref = engines(cls, cfg, workload)
    setup = describe(cfg, workload)
    run_in_lockstep(
        mine,
        ref,
        setup,
        FIRST_DIFFERENCE_HINT.format("scheduler"),
        rules=RULES,
        num_steps=failing - 1,
    )
    setup += (
        f"\nsteps 1-{failing - 1} as labkit's; step {failing} is planned (it preempts r2), then the model fails and"
        f" the engine rolls it back (scheduler.rollback(output)); then r{aborted} is aborted{why}"
    )
    showing(setup)
    want = f"step {failing}'s plan, made before the model fails, preempts [2]"
    for engine in (mine, ref):
        output = planned(engine, setup, want)
        engine.scheduler.rollback(output)
        victims = [r.request_id for r in output.preempted]
        if victims != [2]:
            raise Mismatch(setup, want, f"it preempts {victims}", EVICT_FIRST_HINT)
        engine.abort(aborted)
    run_in_lockstep(mine, ref, setup, hint, rules=RULES, diagnose=False)


def _victims_of_a_failed_step(cls: Any) -> None:
    """The step that first preempts fails in the model and is rolled back; r0 is aborted; the victim goes anyway.

    r0's blocks, given back by the abort, would let every running request grow: only ``self.evict_first``
    says that the rolled-back step's victim must not run on blocks that step may have written into.
    """
    _after_a_failed_step(cls, [(6, 10), (6, 10), (6, 10)], config(num_blocks=9), 0, EVICT_FIRST_HINT)


def _finished_victim_of_a_failed_step(cls: Any) -> None:
    """The rolled-back step's victim, r2, is aborted itself: still listed in ``self.evict_first``, it is FINISHED
    and gone from ``self.running``, so nothing is preempted; a count of all it lists would evict r1 instead."""
    why = " (self.evict_first still lists it)"
    _after_a_failed_step(cls, [(6, 10), (6, 10), (6, 10)], config(num_blocks=9), 2, EVICT_FINISHED_HINT, why)


def _no_admission_after_evicting(cls: Any) -> None:
    """As in :func:`_victims_of_a_failed_step`, with r3 waiting for a seat: r0's abort leaves it a seat and blocks,
    but the step that preempts the rolled-back step's victim admits nothing, though no request needed a block."""
    why = ", which leaves r3 a seat and free blocks"
    cfg = config(num_blocks=9, max_num_seqs=3)
    _after_a_failed_step(cls, [(6, 10), (6, 10), (6, 10), (4, 4)], cfg, 0, NO_ADMIT_HINT, why)


CASES = [
    _case(
        "a lone prompt is prefilled in one step, then decodes one token a step",
        [(6, 3)],
        "a waiting request that fits is admitted (output.admitted.append) with its whole prompt as one chunk"
        " (output.add_chunk(request, 0, n, True)); once admitted it is in self.running and gets one token a step",
    ),
    _case(
        "requests are admitted in arrival order while the budget allows",
        [(8, 2), (8, 2), (8, 2), (8, 2)],
        "walk self.waiting from the front, in order, while budget, max_num_seqs and free blocks allow"
        " (do not pop: update() takes the admitted requests off the queue)",
        max_batch_tokens=20,
    ),
    _case(
        "running requests decode before new prompts are admitted",
        [(5, 6), (5, 6), (12, 2)],
        ORDER_HINT,
        max_batch_tokens=10,
    ),
    _case(
        "a step never schedules more than max_batch_tokens",
        [(10, 4), (10, 4), (10, 4)],
        BUDGET_HINT,
        max_batch_tokens=16,
    ),
    _case(
        "with chunked prefill a long prompt is split across steps",
        [(30, 2), (3, 2)],
        "when a prompt does not fit the budget, schedule min(remaining, budget) of it now and the rest later:"
        " its remaining tokens are request.num_tokens - request.num_computed_tokens",
        max_batch_tokens=12,
    ),
    _case(
        "without chunked prefill a prompt that does not fit waits",
        [(4, 4), (9, 1)],
        "with config.chunked_prefill False an admitted request's first chunk must be its whole prompt: a"
        " waiting request whose prompt does not fit the budget left ends admission",
        max_batch_tokens=10,
        chunked_prefill=False,
    ),
    *(_case(name, workload, PREFILL_CHUNK_HINT, **knobs) for name, (workload, knobs) in PREFILL_CHUNKS.items()),
    _case("max_num_seqs caps the running requests", [(2, 4)] * 5, SEQS_HINT, max_num_seqs=2),
    _case(
        "admission stops when the free blocks run out",
        [(8, 2), (8, 2), (8, 2)],
        "admit a request only if self.allocator.can_allocate(request.request_id, num_tokens); then allocate."
        f" Later, {RECOMPUTE_HINT}",
        num_blocks=5,
    ),
    _case(
        "admission needs the blocks of the first chunk, not of the whole prompt",
        [(4, 3), (14, 1)],
        FIRST_CHUNK_RULE,
        max_batch_tokens=8,
        num_blocks=4,
    ),
    _case(
        "a request that needs a block when none is free preempts the youngest",
        [(6, 10), (6, 10), (6, 10)],
        "before allocating a running request's chunk, while allocator.blocks_needed(...) >"
        " allocator.num_free_blocks, preempt the youngest running request not yet preempted"
        " (self.preempt(output, victim)); stop if that is this very request, and admit nothing in a step that"
        f" preempted. Later, {RECOMPUTE_HINT}",
        num_blocks=9,
    ),
    _case(
        "the youngest request, needing a block when none is free, preempts itself and runs nothing",
        [(4, 6), (4, 6)],
        "while a running request needs more blocks than are free, preempt from the end of self.running; when the"
        " victim is that very request (nothing younger is left), it gets no chunk this step: stop the walk"
        " there, before allocating",
        num_blocks=5,
    ),
    _case(
        "admission stops at the first waiting request that cannot start",
        [(8, 4), (16, 2), (3, 2)],
        "admit from the front of self.waiting and stop at the first request that cannot start (here: not enough"
        " free blocks for its prompt); admitting a later, smaller one instead would let it jump the queue, and"
        " a long request could wait for ever",
        num_blocks=5,
    ),
    Case(
        "a rolled-back step's victims are preempted before anything runs", _victims_of_a_failed_step, EVICT_FIRST_HINT
    ),
    Case(
        "a rolled-back step's victim that finished since is not preempted again",
        _finished_victim_of_a_failed_step,
        EVICT_FINISHED_HINT,
    ),
    Case(
        "a step that preempts a rolled-back step's victims admits nothing",
        _no_admission_after_evicting,
        NO_ADMIT_HINT,
    ),
    property_case("random workloads are scheduled like labkit's scheduler", _strategy, _property, max_examples=40),
]

EXERCISE = Exercise(
    number=3,
    after=("04", "05"),
    slug="scheduler_step",
    title="A scheduler step with a token budget",
    export="MyScheduler",
    reference=lambda: Scheduler,
    cases=CASES,
    seams=("schedule_continuous",),
)
