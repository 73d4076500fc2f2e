"""Scheduler cases: the learner's scheduler and labkit's serve the same requests on the simulated model, in
lockstep, and the first step where they decide differently is the feedback.

The simulated model's tokens depend only on each request's tokens so far, so the two engines see the same
outputs as long as they schedule the same work; a step also checks the rules that hold for any scheduler
(the token budget, ``max_num_seqs``) before it compares, so that breaking one is named outright. The
learner's plan is checked before labkit carries it out, and an error labkit raises while carrying out a
plan is reported as that, not as the learner's code raising.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from labkit.core.blocks import NoFreeBlocksError
from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.report import StepReport
from labkit.core.request import SamplingParams
from labkit.core.scheduler import SchedulerOutput
from labkit.core.sim import SimulatedModel
from labkit.exercises.framework import Mismatch, learner_frames, showing

#: (prompt tokens, max_new_tokens) of each request, in arrival order.
Workload = Sequence[tuple[int, int]]
Invariant = Callable[[Engine, StepReport, EngineConfig], str | None]
MAX_STEPS = 400

SCHEDULED_VICTIM_HINT = (
    "a victim is one of the running requests not scheduled this step: preempt from the end of self.running"
    " (the youngest first) and never a request you have already given a chunk; if the request that needs the"
    " block is the only one left, it is the victim and gets no chunk"
)
ALLOCATE_HINT = (
    "the model writes each planned token's key and value into the request's blocks, so allocate them before"
    " planning the chunk: self.allocator.allocate(request.request_id, num_tokens) covers the request's"
    " first num_tokens tokens"
)
STATIC_RESERVE_HINT = (
    "a static batch's member reserves its whole future when it joins, before its prefill: allocate"
    " num_prompt_tokens + params.max_new_tokens - 1 slots for it (the last token is never fed back)"
)
APPLY_HINT = (
    "after the model ran, Scheduler.update carries your plan out: it takes output.admitted off the front of"
    " self.waiting and output.preempted off the end of self.running, and frees the blocks of the requests that"
    " finish. So a plan changes nothing but the allocator (never pop from or append to the queues, never change"
    " a request) and names each request at most once"
)

RETURN_HINT = (
    "return the SchedulerOutput you filled: output = SchedulerOutput(step=self.step_index + 1, chunks=[]) at the"
    " start, return output at the end (a function that ends without a return statement returns None); labkit"
    " runs the model on the plan it returns"
)
STATIC_RETURN_HINT = (
    "return output.admitted, the list of requests you planned (a function that ends without a return statement"
    " returns None): labkit prefills the batch it returns"
)


FIRST_DIFFERENCE_HINT = "the step above is the first one that differs from labkit's {}"  # what a property case checks

LABEL_HINT = (
    "the same chunks, labelled otherwise: a chunk is a prefill while its request is PREFILLING"
    " (output.add_chunk(request, start, n, request.state is RequestState.PREFILLING)), and a newly admitted"
    " request's first chunk always is; once its prompt is computed, it decodes one token a step"
)


PREFILL_LABEL_HINT = (
    "r{id}'s chunk [{start}:{end}] is a prefill: {why}, and r{id} is PREFILLING until all its request.num_tokens"
    " are computed. Label a chunk by the request's state, output.add_chunk(request, start, n, request.state is"
    " RequestState.PREFILLING): not by how many tokens it has, nor by whether it lies within the prompt"
)
ONE_TOKEN_WHY = "a prompt's last chunk may be a single token"
RECOMPUTE_WHY = (
    "r{id} was preempted, so it recomputes the tokens it generated as well as its prompt, and this chunk lies"
    " past its {prompt}-token prompt"
)
FIRST_CHUNK_RULE = (
    "admit a request when the blocks of its first chunk are free: self.allocator.can_allocate(request.request_id,"
    " n) with n = min(request.num_tokens, budget), the tokens it computes now, not request.num_tokens. With chunked"
    " prefill a long prompt grows its blocks chunk by chunk; asking for all of them up front keeps it waiting"
    " while its first chunk could run"
)
FIRST_CHUNK_HINT = (
    "r{id} can start with a chunk of {chunk} tokens, but your code asked allocator.can_allocate({id}, {asked}): "
    + FIRST_CHUNK_RULE
)
MAKE_ROOM = (
    "before allocating a running request's chunk, make room: while allocator.blocks_needed(request.request_id,"
    " request.num_computed_tokens + n) > allocator.num_free_blocks, preempt the youngest running request not yet"
    " preempted (self.preempt(output, victim)), and if that is the request itself, give it no chunk and stop the"
    " walk there"
)
RUNNING_BLOCKS_HINT = "r{id} is running and its chunk needs more blocks than are free, so allocate raised: " + MAKE_ROOM
BLOCKS_NEEDED_COUNT_HINT = (
    "your code asked allocator.blocks_needed({id}, {asked}) but allocates {num_tokens} tokens for r{id}: ask about"
    " the tokens its table must then cover, request.num_computed_tokens + n, as allocate does, not the chunk's n"
    " alone (a table that holds num_computed_tokens tokens already covers n of them, so that count says no block"
    " is needed and nothing is preempted). " + MAKE_ROOM[0].upper() + MAKE_ROOM[1:]
)
SELF_VICTIM_HINT = (
    "r{id} needs more blocks than are free, and no younger running request is left to preempt: r{id} is its own"
    " victim (self.preempt(output, request)), so it gets no chunk this step: stop the walk there, before"
    " allocating"
)
UNLISTED_HINT = (
    "preempt(output, victim) must list its victim: output.preempted.append(victim). update() takes only the"
    " listed victims off self.running, so an unlisted one stays there without blocks, and a later step that"
    " needs a block picks it as a victim again: freeing its blocks a second time raises KeyError (it owns no"
    " blocks)"
)
VICTIM_ORDER_HINT = (
    "list the victims in the order they are preempted, the youngest first: output.preempted.append(victim), not"
    " insert(0, victim). update() requeues them in that order, each at the front of the waiting queue, so that"
    " the oldest victim ends up first and runs again before the younger ones"
)


EMPTY_CHUNK_HINT = (
    "a chunk is at least one token: give a request a chunk only while the budget is positive, and stop walking"
    " and admitting once it reaches 0"
)
PREEMPTED_HINT = (
    "the steps differ in whom they preempt. A running request preempts only while it needs more blocks than"
    " are free (allocator.blocks_needed(request.request_id, request.num_computed_tokens + n) >"
    " allocator.num_free_blocks), the youngest running request not yet preempted first (from the end of"
    " self.running), and preempt() frees the victim's blocks at once, so that they count as free for the rest"
    " of the same step"
)
REQUEUE_ORDER_HINT = (
    "the same requests, admitted in another order: a preempted request waits again at the front of"
    " self.waiting (appendleft), ahead of the requests that arrived after it, and admission walks the queue"
    " from the front"
)
RECOMPUTED_HINT = (
    "r{id} was preempted earlier, so it starts again from token 0 and recomputes all its request.num_tokens"
    " (its prompt and the tokens it generated, which it keeps), not just its prompt"
)

CONTINUE_HINT = (
    "r{id} is running with {computed} tokens computed, so its chunk starts at token {computed}, not {start}: a"
    " running request's chunk continues from request.num_computed_tokens (output.add_chunk(request,"
    " request.num_computed_tokens, n, ...)), and its blocks must cover num_computed_tokens + n tokens"
)


def divergence_hint(expected: StepReport, got: StepReport, preempted_before: set[int]) -> str | None:
    """A hint naming how the learner's step differs from labkit's, when the difference itself says (whom it preempts,
    the order it admits in, how much a recomputed request recomputes, where a running request's chunk starts);
    else None."""
    if list(expected.preempted) != list(got.preempted):
        return PREEMPTED_HINT
    if expected.admitted != got.admitted and sorted(expected.admitted) == sorted(got.admitted):
        return REQUEUE_ORDER_HINT
    lengths = {w.request_id: (w.start, w.num_tokens) for w in expected.scheduled}
    for work in got.scheduled:
        want = lengths.get(work.request_id)
        if work.request_id in preempted_before and work.start == 0 and want and want != (0, work.num_tokens):
            return RECOMPUTED_HINT.format(id=work.request_id)
    for work in got.scheduled:
        want = lengths.get(work.request_id)
        if want and want[0] != work.start and work.request_id not in got.admitted:
            return CONTINUE_HINT.format(id=work.request_id, start=work.start, computed=want[0])
    return None


def label_hint(engine: Engine, expected: StepReport, got: StepReport) -> str:
    """The hint for a step with labkit's chunks, labelled otherwise: the first chunk the learner calls a decode
    that is a prefill of a single token, or of a recomputed request past its prompt, says so; else LABEL_HINT."""
    for want, have in zip(expected.scheduled, got.scheduled, strict=False):
        if want.is_prefill == have.is_prefill:
            continue
        request = engine.requests.get(have.request_id)
        if request is not None and have.start >= request.num_prompt_tokens:
            why = RECOMPUTE_WHY.format(id=have.request_id, prompt=request.num_prompt_tokens)
        elif have.num_tokens == 1:
            why = ONE_TOKEN_WHY
        else:
            why = ""
        if not want.is_prefill or not why:
            return LABEL_HINT
        end = have.start + have.num_tokens
        return PREFILL_LABEL_HINT.format(id=have.request_id, start=have.start, end=end, why=why)
    return LABEL_HINT


def listing_problem(step: int, called: Sequence[int], listed: Sequence[int]) -> tuple[str, str] | None:
    """(what is wrong, hint) when the victims that preempt() was called on in ``step`` (``called``, request ids in
    call order) are not what output.preempted lists (``listed``): one left out, or the same ones in another order."""
    missing = [i for i in called if i not in listed]
    if missing:
        names = ", ".join(f"r{i}" for i in missing)
        message = f"step {step} called preempt(output, {names}), but output.preempted lists {list(listed)}"
        return message, UNLISTED_HINT
    if list(listed) != list(called) and sorted(listed) == sorted(called):
        names = " then ".join(f"r{i}" for i in called)
        message = f"step {step} preempted {names}, but output.preempted lists {list(listed)}"
        return message, VICTIM_ORDER_HINT
    return None


class _BadPlan(Exception):
    """A plan that labkit cannot carry out: raised before the model runs, so that the step rolls back."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.message, self.hint = message, hint


def plan_problem(engine: Engine, output: SchedulerOutput) -> tuple[str, str] | None:
    """(what is wrong, hint) for a plan that labkit could not carry out faithfully; None for a sound one."""
    preempted = {r.request_id for r in output.preempted}
    allocator = engine.allocator
    for chunk in output.chunks:
        request_id, end = chunk.request.request_id, chunk.start + chunk.num_tokens
        where = f"r{request_id} [{chunk.start}:{end}]"
        if request_id in preempted:
            return f"step {output.step} schedules {where} and also preempts r{request_id}", SCHEDULED_VICTIM_HINT
        if chunk.num_tokens < 1:
            return f"step {output.step} schedules {where}, a chunk of {chunk.num_tokens} tokens", EMPTY_CHUNK_HINT
        slots = len(allocator.block_tables.get(request_id, ())) * allocator.block_size
        if slots < end:
            message = f"step {output.step} schedules {where}, but r{request_id}'s blocks hold {slots} tokens"
            return message, STATIC_RESERVE_HINT if engine.config.policy == "static" else ALLOCATE_HINT
    return None


def planned(engine: Engine, setup: str, want: str) -> SchedulerOutput:
    """``engine``'s next plan, outside a step (as the engine's rollback tests make one): a plan that
    :func:`check_plans` refuses is a Mismatch against ``want``, what labkit's plan does, after ``setup``."""
    try:
        return engine.scheduler.schedule()
    except _BadPlan as bad:
        raise Mismatch(setup, want, bad.message, bad.hint) from None


def planner_state(scheduler: Any) -> dict[str, Any]:
    """What a plan may read but not change: the queues' order and each unfinished request's progress."""
    state = {"the waiting queue": [r.request_id for r in scheduler.waiting]}
    state["self.running"] = [r.request_id for r in scheduler.running]
    for request_id, r in scheduler.requests.items():
        state[f"r{request_id}"] = (
            f"{r.state.name}, {r.num_computed_tokens} computed, {len(r.output_token_ids)} generated"
        )
    return state


def plan_changes(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """What planning changed, said as before -> after; None if nothing."""
    changed = [
        f"{name}: {before.get(name)} -> {after.get(name)}"
        for name in {**before, **after}
        if before.get(name) != after.get(name)
    ]
    return "; ".join(changed) or None


def _returned(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


class _PlanWatch:
    """What the code planning a step calls on ``engine``'s scheduler and allocator (instance attributes, this engine
    only): whom preempt() is called on, which request each allocate is for, and how many tokens each
    blocks_needed called outside the allocator's own methods asks about."""

    def __init__(self, engine: Engine) -> None:
        scheduler, allocator = engine.scheduler, engine.allocator
        self.running: list[int] = []  # self.running's request ids when the plan started
        self.victims: list[int] = []
        self.allocations: list[tuple[Any, int]] = []  # (request id, num_tokens)
        self.asked: dict[Any, int] = {}  # request id -> num_tokens of the last blocks_needed call for it
        self.asked_to_start: dict[Any, int] = {}  # request id -> num_tokens of the last can_allocate call for it
        inner = [0]  # inside one of the allocator's own methods, whose calls of blocks_needed are not the plan's
        preempt, allocate = scheduler.preempt, allocator.allocate
        blocks_needed, can_allocate = allocator.blocks_needed, allocator.can_allocate

        def watched_preempt(output: SchedulerOutput, victim: Any) -> None:
            self.victims.append(victim.request_id)
            preempt(output, victim)

        def inside(method: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                inner[0] += 1
                try:
                    return method(*args, **kwargs)
                finally:
                    inner[0] -= 1

            return call

        def watched_allocate(request_id: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
            self.allocations.append((request_id, num_tokens))
            return inside(allocate)(request_id, num_tokens, *args, **kwargs)

        def watched_can_allocate(request_id: Any, num_tokens: int, *args: Any, **kwargs: Any) -> bool:
            if not inner[0]:
                self.asked_to_start[request_id] = num_tokens
            return inside(can_allocate)(request_id, num_tokens, *args, **kwargs)

        def watched_blocks_needed(request_id: Any, num_tokens: int) -> int:
            if not inner[0]:
                self.asked[request_id] = num_tokens
            return blocks_needed(request_id, num_tokens)

        scheduler.preempt = watched_preempt
        allocator.allocate, allocator.can_allocate = watched_allocate, watched_can_allocate
        allocator.blocks_needed = watched_blocks_needed

    def start(self, running: Sequence[Any]) -> None:
        self.running = [r.request_id for r in running]
        self.victims.clear()
        self.allocations.clear()
        self.asked.clear()
        self.asked_to_start.clear()

    def admission_hint(self, expected: StepReport, got: StepReport) -> str | None:
        """FIRST_CHUNK_HINT when labkit's step admits a request that the learner's does not, after asking
        can_allocate about more tokens than that request's first chunk."""
        for work in expected.scheduled:
            request_id, end = work.request_id, work.start + work.num_tokens
            asked = self.asked_to_start.get(request_id)
            if request_id in expected.admitted and request_id not in got.admitted and asked and asked > end:
                return FIRST_CHUNK_HINT.format(id=request_id, chunk=end, asked=asked)
        return None

    def out_of_blocks(self) -> str | None:
        """The hint for a NoFreeBlocksError that the plan's last allocate raised, if it was for a running request."""
        if not self.allocations or self.allocations[-1][0] not in self.running:
            return None
        request_id, num_tokens = self.allocations[-1]
        asked = self.asked.get(request_id)
        if asked is not None and asked != num_tokens:
            return BLOCKS_NEEDED_COUNT_HINT.format(id=request_id, asked=asked, num_tokens=num_tokens)
        younger = self.running[self.running.index(request_id) + 1 :]
        if all(i in self.victims for i in younger):
            return SELF_VICTIM_HINT.format(id=request_id)
        return RUNNING_BLOCKS_HINT.format(id=request_id)


def check_plans(engine: Engine) -> _PlanWatch:
    """Make ``engine``'s scheduler raise _BadPlan, before the model runs, on a plan that is no SchedulerOutput (or a
    static batch that is no list), one whose output.preempted is not whom preempt() was called on
    (:func:`listing_problem`), one with a :func:`plan_problem` or one that changed a request or a queue while
    planning (only ``update`` may: a failed step rolls back), and where the learner's code raises
    NoFreeBlocksError allocating a running request's chunk (:meth:`_PlanWatch.out_of_blocks`). Returns the watch,
    which also says what a continuous step that admits less than labkit's asked the allocator about."""
    scheduler = engine.scheduler
    plan, form = scheduler.schedule, scheduler.form_static_batch
    watch = _PlanWatch(engine)

    def form_static_batch(output: SchedulerOutput) -> Any:
        batch = form(output)
        if not isinstance(batch, list):
            message = f"step {output.step}: form_static_batch returned {_returned(batch)}"
            raise _BadPlan(message, STATIC_RETURN_HINT)
        return batch

    def schedule() -> SchedulerOutput:
        before = planner_state(scheduler)
        watch.start(scheduler.running)
        try:
            output = plan()
        except NoFreeBlocksError as error:
            where, hint = learner_frames(error), watch.out_of_blocks()
            if not where or hint is None:
                raise
            raise _BadPlan(f"your code raised NoFreeBlocksError: {error}\n{where}", hint) from None
        if not isinstance(output, SchedulerOutput):
            message = f"step {scheduler.step_index + 1}: schedule_continuous returned {_returned(output)}"
            raise _BadPlan(message, RETURN_HINT)
        problem = listing_problem(output.step, watch.victims, [r.request_id for r in output.preempted])
        if problem is not None:
            raise _BadPlan(*problem)
        changes = plan_changes(before, planner_state(scheduler))
        if changes is not None:
            raise _BadPlan(f"planning step {output.step} changed {changes}", APPLY_HINT)
        problem = plan_problem(engine, output)
        if problem is not None:
            raise _BadPlan(*problem)
        return output

    scheduler.schedule = schedule  # this engine's scheduler only: an instance attribute
    scheduler.form_static_batch = form_static_batch
    return watch


def prompts(workload: Workload) -> list[list[int]]:
    """Distinct prompts of the given lengths (tokens 2..; 0 is padding and 1 is EOS on the simulated model)."""
    return [[2 + (7 * i + 3 * j) % 60 for j in range(length)] for i, (length, _) in enumerate(workload)]


def describe(config: EngineConfig, workload: Workload) -> str:
    knobs = ", ".join(
        f"{k}={getattr(config, k)}"
        for k in ("policy", "max_batch_tokens", "max_num_seqs", "num_blocks", "block_size", "chunked_prefill")
    )
    requests = ", ".join(f"r{i}: {p} prompt + {n} new" for i, (p, n) in enumerate(workload))
    return f"EngineConfig({knobs})\nrequests (arrival order): {requests}"


def step_text(report: StepReport) -> str:
    work = [
        f"{'prefill' if w.is_prefill else 'decode'} r{w.request_id} [{w.start}:{w.start + w.num_tokens}]"
        for w in report.scheduled
    ]
    extra = [f"admitted {list(report.admitted)}"] if report.admitted else []
    extra += [f"preempted {list(report.preempted)}"] if report.preempted else []
    extra += [f"padding {sum(w.num_tokens for w in report.padding)} rows"] if report.padding else []
    return "; ".join(work or ["nothing"]) + ("; " + "; ".join(extra) if extra else "")


def budget_rule(engine: Engine, report: StepReport, config: EngineConfig) -> str | None:
    spent = report.num_prefill_tokens + report.num_decode_tokens
    if spent > config.max_batch_tokens:
        return f"step {report.step} schedules {spent} tokens, but max_batch_tokens is {config.max_batch_tokens}"
    return None


def max_seqs_rule(engine: Engine, report: StepReport, config: EngineConfig) -> str | None:
    if report.num_running > config.max_num_seqs:
        return f"after step {report.step}, {report.num_running} requests run, but max_num_seqs is {config.max_num_seqs}"
    return None


def lockstep(
    scheduler_cls: Any,
    config: EngineConfig,
    workload: Workload,
    hint: str,
    rules: Sequence[tuple[Invariant, str]] = (),
    after_step: tuple[Callable[[Engine, StepReport], str | None], str] | None = None,
) -> None:
    """Serve ``workload`` with ``scheduler_cls`` and with labkit's Scheduler; Mismatch at the first difference.

    ``rules`` are (check, hint) pairs run on each of the learner's steps first; ``after_step`` may check the
    learner's engine state after each step: a (check, hint) pair whose check returns a message, or None.
    """
    mine, ref = engines(scheduler_cls, config, workload)
    run_in_lockstep(mine, ref, describe(config, workload), hint, rules=rules, after_step=after_step)


def engines(scheduler_cls: Any, config: EngineConfig, workload: Workload) -> tuple[Engine, Engine]:
    """Two engines on the simulated model holding ``workload``'s requests: the learner's scheduler, and labkit's."""
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in workload]
    mine = Engine(SimulatedModel(), config, scheduler_cls=scheduler_cls)
    ref = Engine(SimulatedModel(), config)
    for engine in (mine, ref):
        for prompt, p in zip(prompts(workload), params, strict=True):
            engine.add_request(prompt, p)
    return mine, ref


def run_in_lockstep(
    mine: Engine,
    ref: Engine,
    setup: str,
    hint: str,
    *,
    rules: Sequence[tuple[Invariant, str]] = (),
    after_step: tuple[Callable[[Engine, StepReport], str | None], str] | None = None,
    show: Callable[[StepReport], str] = step_text,
    num_steps: int | None = None,
    diagnose: bool = True,
) -> None:
    """Step two engines holding the same requests until both finish; Mismatch at the first step that differs.

    ``setup`` describes the run for the feedback; ``show`` is what a step is compared by (its scheduled
    work, by default). ``rules`` and ``after_step`` as in :func:`lockstep`; the config the rules see is ``mine``'s.
    With ``num_steps``, stop after that many steps (or sooner, once both finish). With ``diagnose``, a step
    whose difference names its cause (whom it preempts, the order it admits in, how much a recomputed request
    recomputes: :func:`divergence_hint`) gets that hint first, then ``hint`` as what the case checks.
    """
    done: list[str] = []
    preempted_before: set[int] = set()
    showing(setup)
    watch = check_plans(mine)
    continuous = mine.config.policy == "continuous"  # a static batch asks can_allocate about its whole future
    for _ in range(MAX_STEPS if num_steps is None else num_steps):
        if not ref.has_unfinished() and not mine.has_unfinished():
            return
        so_far = "\n".join([setup, *history(done)])
        showing(f"{so_far}\n(in step {mine.scheduler.step_index + 1})")
        expected = ref.step()
        want = f"step {expected.step}: {show(expected)}"
        try:
            got = mine.step()
        except _BadPlan as bad:
            raise Mismatch(so_far, want, bad.message, bad.hint) from None
        except Exception as error:
            if learner_frames(error):  # raised in the learner's own code: shown as theirs
                raise
            got_text = f"labkit raised while applying your plan: {type(error).__name__}: {error}"
            raise Mismatch(so_far, want, got_text, APPLY_HINT) from error
        for rule, rule_hint in rules:
            message = rule(mine, got, mine.config)
            if message is not None:
                raise Mismatch(so_far, want, message, rule_hint)
        if show(expected) != show(got):
            relabelled = show(expected).replace("prefill ", "decode ") == show(got).replace("prefill ", "decode ")
            cause = None
            if diagnose and not relabelled:
                cause = divergence_hint(expected, got, preempted_before)
                cause = cause or (watch.admission_hint(expected, got) if continuous else None)
            if relabelled:
                step_hint = label_hint(mine, expected, got)
            elif cause is None:
                step_hint = hint
            else:  # a case that checks no more than the first difference adds nothing to the cause
                generic = hint.startswith(FIRST_DIFFERENCE_HINT.format(""))
                step_hint = cause if generic or hint in cause else f"{cause}. What this case checks: {hint}"
            raise Mismatch(so_far, want, f"step {got.step}: {show(got)}", step_hint)
        if after_step is not None:
            message = after_step[0](mine, got)
            if message is not None:
                raise Mismatch(so_far, want, message, after_step[1])
        done.append(want)
        preempted_before.update(expected.preempted)
    if num_steps is None:
        raise Mismatch(setup, "every request finishes", f"requests still unfinished after {MAX_STEPS} steps", hint)


def history(done: Sequence[str]) -> list[str]:
    """The last six steps, and every earlier one that preempted (a recomputation later is checked against it)."""
    lines, previous = [], -1
    for i, line in enumerate(done):
        if i >= len(done) - 6 or "preempted" in line:
            lines += ["..."] * (i > previous + 1) + [line]
            previous = i
    return lines


def config(**overrides: Any) -> EngineConfig:
    base = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=32, max_num_seqs=8)
    return replace(base, **overrides)
