"""The engine loop: schedule a step, run the model on it, record what came out. Plain Python, no torch.

The model side is a *runner*: an object that owns the KV cache and turns a SchedulerOutput into one
sampled token per chunk that samples (a decode, or a prompt's last chunk). A transformers model gets
labkit's torch ModelRunner; a SimulatedModel gets a runner that only advances a simulated clock.
Allocator and scheduler classes can be swapped (``allocator_cls=``, ``scheduler_cls=``), and so can the
torch runner's slot mapping, attention and sampler (``slot_mapping_fn=``, ``attention_fn=``,
``sampler=``): that is how the exercises plug in.

With ``EngineConfig(async_scheduling=True)`` the engine keeps one step launched ahead: it plans and
launches step N+1 while the model still runs step N (see ``Engine.step``).

A step is all or nothing (``Engine.step``). A plugged-in scheduler keeps that promise by changing
requests and queues only in ``update`` (``schedule`` plans); a plugged-in allocator by changing its
state through BlockAllocator's methods, or journalling its own (``BlockAllocator.record_undo``).
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import CodeType
from typing import Any, Protocol, cast

from labkit.core.blocks import BlockAllocator
from labkit.core.config import EngineConfig
from labkit.core.interrupts import HeldInterrupt
from labkit.core.report import ScheduledWork, StepReport
from labkit.core.request import (
    PENDING_TOKEN,
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    as_int,
    as_token_id,
    check_request_length,
    is_token_sequence,
    prompt_token_ids,
)
from labkit.core.scheduler import Scheduler, SchedulerOutput


class Runner(Protocol):
    """What the engine needs from the model side."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    device_name: str

    def clock(self) -> float: ...

    def init_cache(self, block_size: int, num_blocks: int | None) -> int:
        """Allocate the KV cache (sized from memory when ``num_blocks`` is None); return its block count."""

    def execute(self, output: SchedulerOutput, allocator: BlockAllocator) -> list[int]:
        """Run one step; return one token per chunk with ``samples=True``, in order."""

    def wait_until(self, t: float) -> None:
        """Idle until ``clock() >= t``: a simulated clock jumps, a real one sleeps (the online driver uses it)."""


class AsyncRunner(Runner, Protocol):
    """A runner that async scheduling can drive: it starts a step, and hands its tokens over later.

    ``launch`` may return before the model has run (a GPU queues the work). A chunk's input token can be
    the placeholder PENDING_TOKEN: its value is the sample that ``previous`` (the step launched just
    before) drew for the same request, and the runner reads it where it lies (on the device).
    """

    def launch(self, output: SchedulerOutput, allocator: BlockAllocator, previous: Any = None) -> Any:
        """Start one step; return a handle on its samples for ``collect``."""

    def collect(self, launched: Any) -> list[int]:
        """Wait for a launched step; return one token per chunk with ``samples=True``, in order."""

    def ready_time(self, launched: Any) -> float | None:
        """When a launched step's tokens were ready, if the runner computed them in ``launch`` (a CPU, the
        simulator); None where they are read as they arrive (a GPU): the time ``collect`` returned."""


#: What async scheduling calls on a runner beyond Runner's methods (AsyncRunner).
ASYNC_RUNNER_METHODS = ("launch", "collect", "ready_time")

#: Builds the runner of a model that does not make its own (a transformers model). The top-level ``labkit``
#: package plugs in the torch runtime's ModelRunner here, imported only when first used, so the core layer
#: never names the runtime and ``import labkit`` stays torch-free.
RunnerFactory = Callable[..., Runner]
default_runner_factory: RunnerFactory | None = None


def make_runner(model: Any, config: EngineConfig, **parts: Any) -> Runner:
    """A model that knows its runner (e.g. SimulatedModel) makes it; anything else goes to the default factory.

    ``parts`` are the runner parts to swap (``slot_mapping_fn``, ``attention_fn``, ``sampler``), given only
    when set: a runner that computes no attention refuses them.
    """
    if hasattr(model, "make_runner"):
        if parts:
            raise TypeError(f"{', '.join(parts)}: a {type(model).__name__} computes no attention and samples nothing")
        return model.make_runner(config)
    if default_runner_factory is None:
        raise TypeError(f"no runner for a model of type {type(model).__name__}: no default runner factory is set")
    return default_runner_factory(model, config, **parts)


def _learners_code(parts: Iterable[object]) -> set[CodeType]:
    """The code of the methods that classes from outside labkit define for ``parts``, so that a Ctrl-C can tell a
    learner's code from labkit's own by the frame it lands in: a learner's subclass, or class of their own (not
    labkit's core, nor an exercise's wrapper around it: allocator_for a labkit PrefixCache, say)."""
    classes = {cls for part in parts if part is not None for cls in type(part).__mro__}
    outside = (cls for cls in classes if not cls.__module__.startswith(("labkit.", "builtins")))
    functions = (getattr(value, "__func__", value) for cls in outside for value in vars(cls).values())  # unwrapped
    return {function.__code__ for function in functions if hasattr(function, "__code__")}


class Engine:
    """An inference engine that batches requests step by step over a paged KV cache."""

    def __init__(
        self,
        model: Any,
        config: EngineConfig | None = None,
        tokenizer: Any = None,
        *,
        allocator_cls: Callable[..., BlockAllocator] = BlockAllocator,
        scheduler_cls: Callable[[EngineConfig, BlockAllocator], Scheduler] = Scheduler,
        slot_mapping_fn: Callable[..., list[int]] | None = None,
        attention_fn: Callable[..., Any] | None = None,
        sampler: Callable[..., list[int]] | None = None,
    ) -> None:
        if config is None:
            config = EngineConfig()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        plugged = (("allocator_cls", allocator_cls, BlockAllocator), ("scheduler_cls", scheduler_cls, Scheduler))
        for name, part, base in plugged:
            if not callable(part) or (isinstance(part, type) and not issubclass(part, base)):
                raise TypeError(f"{name} must be a subclass of {base.__name__} (or make one), got {part!r}")
        self.config = config
        self.tokenizer = tokenizer
        parts = {"slot_mapping_fn": slot_mapping_fn, "attention_fn": attention_fn, "sampler": sampler}
        self.runner = make_runner(model, config, **{name: part for name, part in parts.items() if part is not None})
        self.clock = self.runner.clock
        if config.async_scheduling:  # a runner that lacks a method is refused now, not by every step()
            missing = [name for name in ASYNC_RUNNER_METHODS if not callable(getattr(self.runner, name, None))]
            if missing:
                raise ValueError(
                    f"async_scheduling needs a runner that launches a step before reading its tokens;"
                    f" {type(self.runner).__name__} has no {', '.join(f'{name}()' for name in missing)}"
                )
        num_blocks = self.runner.init_cache(config.block_size, config.num_blocks)
        try:
            if config.enable_prefix_caching:
                self.allocator = allocator_cls(num_blocks, config.block_size, enable_prefix_caching=True)
            else:
                self.allocator = allocator_cls(num_blocks, config.block_size)
            if not isinstance(self.allocator, BlockAllocator):
                raise TypeError(f"allocator_cls made a {type(self.allocator).__name__}, not a BlockAllocator")
            self.scheduler = scheduler_cls(config, self.allocator)
            if not isinstance(self.scheduler, Scheduler):
                raise TypeError(f"scheduler_cls made a {type(self.scheduler).__name__}, not a Scheduler")
        except BaseException:
            # An engine refused here must not keep what its runner took: ModelRunner converted the model.
            discard = getattr(self.runner, "discard", None)
            if discard is not None:
                discard()
            raise
        self.requests: dict[int, Request] = {}
        self.step_listeners: list[Callable[[StepReport], None]] = []
        self._ids = itertools.count()
        self._aborted: list[Request] = []  # aborted between steps: reported with the next step
        self._ahead: deque[_LaunchedStep] = deque()  # async scheduling: committed steps whose tokens are not read
        # The engine plans and changes its state with a Ctrl-C held; one that lands in a learner's scheduler or queue
        # while a step is planned acts at once, so that their loop stays interruptible (labkit/core/interrupts.py).
        self._held = HeldInterrupt(
            acts_in=_learners_code([self.scheduler, getattr(self.scheduler, "waiting", None)]),
            waits_in=_learners_code([self.allocator, self.allocator.prefix_cache]),
            way_out=True,
        )

    # ------------------------------------------------------------------ state
    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose keys and values the prefix cache indexes, in use or reusable (0 with caching off)."""
        cache = self.allocator.prefix_cache
        return 0 if cache is None else len(cache.digest_of)

    @property
    def device_name(self) -> str:
        return self.runner.device_name

    @property
    def cut_short(self) -> bool:
        """Whether a Ctrl-C may have stopped the engine's code half-way: pressed again once one had waited
        ``STUCK_SECONDS`` (the way out of a loop stuck in a plugged-in part). The blocks and queues may then not add
        up, and the engine refuses to go on: make a new one."""
        return self._held.cut_short

    def _refuse_if_cut_short(self) -> None:
        if self._held.cut_short:
            raise RuntimeError(
                "a second Ctrl-C may have stopped the engine's code half-way (the first had waited half a second):"
                " this engine's blocks and queues may not add up; make a new Engine"
            )

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has work left: unfinished requests, steps launched ahead (async scheduling), or aborts
        that no StepReport has listed yet, so that a ``while engine.has_unfinished(): engine.step()`` loop reports
        every request's end, and every block it freed, to the step listeners (a recorder, a widget)."""
        return self.scheduler.has_unfinished() or bool(self._ahead) or bool(self._aborted)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
    ) -> int:
        """Queue a prompt (a sequence of token ids, or text when the engine has a tokenizer); return its request id.

        Everything about the request is checked here (``check_request``), so a bad request is refused with a
        ValueError/TypeError before it touches the cache, and the other requests carry on.
        """
        self._refuse_if_cut_short()
        token_ids, params = self.check_request(prompt, params)
        now = self.clock() if arrival_time is None else _arrival_time(arrival_time, self.clock())
        request_id = next(self._ids)
        request = Request(
            request_id,
            token_ids,
            params,
            eos_token_ids=self.runner.eos_token_ids,
            metrics=RequestMetrics(arrival_time=now),
        )
        added = False
        try:
            with self._held_bookkeeping():
                self.scheduler.add(request)
                self.requests[request_id] = request
                added = True
            return request_id
        except BaseException:
            while added:  # a Ctrl-C, delivered once the request was in: the caller gets no id, so nothing is left added
                try:  # (a second Ctrl-C meanwhile: clean up all the same, then raise)
                    self.forget([request_id], report=False)
                    break
                except KeyboardInterrupt:
                    continue
            raise

    def check_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> tuple[list[int], SamplingParams]:
        """Check a request as ``add_request`` does, without queueing it; return its prompt's token ids and params.

        A caller with many requests (the online driver) checks them all first, so that a bad one is refused
        before any of them runs.
        """
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_token_ids(prompt)
        vocab = self.runner.vocab_size
        for token in params.stop_token_ids:
            if not 0 <= token < vocab:
                raise ValueError(f"stop token id {token} is outside the vocabulary [0, {vocab})")
        check_request_length(len(token_ids), params, self.runner.max_model_len)
        self.scheduler.check_fits(len(token_ids), params.max_new_tokens)
        return token_ids, params

    def abort(self, request_id: int) -> None:
        """Stop a request now; the next StepReport lists it as finished ("abort").

        Its blocks are freed at once, except in a static batch, which keeps every member's blocks (and row)
        until the batch ends.

        KeyError if no unfinished request has that id; TypeError for an id that is not an int.
        """
        request_id = as_int("request_id", request_id)
        with self._held_bookkeeping():
            self._aborted.append(self.scheduler.abort(request_id, self.clock()))

    @contextmanager
    def _held_bookkeeping(self) -> Iterator[None]:
        """Change the engine's state between steps with a Ctrl-C held, and deliver it after (inside a hold already
        on, that one delivers it)."""
        held = self._held
        if held.holding:
            yield
            return
        waiting = held.pending  # a Ctrl-C held in a step's commit waits for its listeners, this one among them
        held.hold()
        try:
            yield
        finally:
            if waiting:
                held.release()
            else:
                held.deliver()

    def report_aborts(self) -> list[StepReport]:
        """Report the ends of requests aborted since the last step now, in steps of their own, when nothing else
        is left to run (with async scheduling, the steps launched for them finish too); else they go with the
        next step's report. ``generate`` and the online driver call it first, so that a run's reports hold its
        own requests, not those of a run cut short before it (a Ctrl-C in a notebook cell, then the cell again).
        """
        reports = []
        while (self._aborted or self._ahead) and not self.scheduler.has_unfinished():
            reports.append(self.step())
        return reports

    def release(self, request_id: int) -> RequestOutput:
        """Return a finished request's output and forget it.

        ``requests`` keeps every request added until it is released, so that its output can be read at
        any time; a server that serves requests one by one with ``add_request`` and ``step`` releases each
        one it is done with (``generate`` and the online driver release theirs). KeyError for an unknown id,
        ValueError for a request that is still running (abort it first) or whose last token is still being
        read (async scheduling: step once more). TypeError for an id that is not an int.
        """
        request_id = as_int("request_id", request_id)
        request = self.requests[request_id]
        if request.finish_reason is None or PENDING_TOKEN in request.output_token_ids:
            raise ValueError(f"request {request_id} has not finished: abort() it, or step() until it has")
        output = self.output(request_id)
        del self.requests[request_id]
        return output

    def output(self, request_id: int) -> RequestOutput:
        """What ``request_id`` has generated so far: a snapshot, so that later steps leave it as it was.

        With async scheduling it holds the tokens read so far, and only their times; a request whose last token is
        still being read has not finished yet (its finish reason may still change from "length" to "stop").
        """
        request_id = as_int("request_id", request_id)
        request = self.requests[request_id]
        outputs, metrics = request.output_token_ids, request.metrics
        read = len(outputs)
        while read and outputs[read - 1] == PENDING_TOKEN:  # async: placeholders stand only at the end
            read -= 1
        finish_reason = request.finish_reason if read == len(outputs) else None
        tokens = outputs[:read]
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=tokens,
            text=text,
            finish_reason=finish_reason,
            metrics=replace(
                metrics,
                first_token_time=metrics.first_token_time if read else None,
                finish_time=metrics.finish_time if finish_reason is not None else None,
                token_times=metrics.token_times[:read],
            ),
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepReport:
        """Run one iteration: schedule, execute the model once on the packed batch, update requests.

        A step is all or nothing. If anything raises before the scheduler commits (in ``schedule``, the
        model, the sampler, a plugged-in allocator or scheduler, a KeyboardInterrupt), the step is rolled
        back: queues, block tables, free blocks and every request are as they were, the exception
        propagates, and the next ``step()`` does the same work again. A Ctrl-C acts at once while the model
        runs; during labkit's own planning and the commit it waits for the model's run or the step's end
        (``labkit.core.interrupts``). Step listeners run after the commit: one that raises
        does not undo the step.

        With async scheduling each call launches the next step first and then finishes the oldest one
        launched (the first call launches two), so the report that comes back is one step behind the
        model. A call that raises has launched nothing new, or finished nothing, and the next one goes on.
        """
        self._refuse_if_cut_short()
        if self.config.async_scheduling:
            return self._step_ahead()
        scheduler, held = self.scheduler, self._held
        output = None
        held.hold(learners_code_acts=True)  # planning: a Ctrl-C waits for the model's run, where it stops the step
        try:
            output = scheduler.schedule()
            free_in_step = self.allocator.num_free_blocks  # the step's blocks taken, none given back yet
            start = self.clock()
            held.open()
            sampled = [] if output.is_empty else self.runner.execute(output, self.allocator)
            end = self.clock()
            held.hold()
            finished = scheduler.update(output, sampled, end)  # the commit
        except BaseException:
            # The step is rolled back whatever comes: a Ctrl-C meanwhile is raised after it. (Written out here and in
            # _launch, not a helper's: a function's entry is where Python raises a pending KeyboardInterrupt.)
            while True:
                try:
                    held.hold()
                    scheduler.rollback(output)
                    break
                except KeyboardInterrupt:
                    continue
            held.deliver()
            raise
        try:
            self._note_first_scheduled(output, start)
            finished[:0] = self._aborted
            self._aborted = []
            report = self._report(output, sampled, finished, start, end, self._report_state(free_in_step))
        except BaseException:
            held.deliver()
            raise
        return self._publish_then_deliver(report)

    def _step_ahead(self) -> StepReport:
        """Async scheduling: keep two steps launched, then finish the older one."""
        ahead = self._ahead
        if ahead and self._aborted:
            # The aborts, and the blocks they gave back, go to the report of the newest step launched: as without
            # async scheduling, not to a later step's, which may take those blocks, and not to an older one's when
            # two are in flight (after a call that failed reading tokens), which would report them before the
            # newer step's report admits the request and takes its blocks.
            self._note_given_back(ahead[-1])
            ahead[-1].finished[:0] = self._aborted
            self._aborted = []
        # Keep two steps in flight. The first may be empty, so that there is a step to report; after an empty one,
        # launch nothing more (it had nothing to run), and stop when there is nothing to launch.
        while len(ahead) < 2 and not (ahead and ahead[-1].output.is_empty):
            if not self._launch(keep_empty=not ahead):
                break
        return self._finish_oldest()

    def _launch(self, *, keep_empty: bool) -> bool:
        """Plan the next step as if every launched one had gone on, launch it, commit it with placeholder tokens.

        Returns False, having changed nothing, when there is nothing to run and ``keep_empty`` is false.
        """
        scheduler, runner, held = self.scheduler, cast(AsyncRunner, self.runner), self._held
        output = None
        held.hold(learners_code_acts=True)  # planning: a Ctrl-C waits for the launch, where it stops the step
        try:
            output = scheduler.schedule()
            free_in_step = self.allocator.num_free_blocks  # the step's blocks taken, none given back yet
            launch = keep_empty or not output.is_empty
            if launch:
                start = self.clock()
                previous = self._ahead[-1].handle if self._ahead else None
                held.open()
                handle = None if output.is_empty else runner.launch(output, self.allocator, previous)
                placeholders = [PENDING_TOKEN] * sum(1 for chunk in output.chunks if chunk.samples)
                held.hold()
                finished = scheduler.update(output, placeholders, start)  # the commit, tokens to follow
            else:
                held.hold()  # the rollback is held throughout, a learner's code in it too
                scheduler.rollback()  # planned, never run: nothing was written into its victims' blocks
        except BaseException:
            while True:  # rolled back whatever comes, as in step()
                try:
                    held.hold()
                    scheduler.rollback(output)
                    break
                except KeyboardInterrupt:
                    continue
            held.deliver()
            raise
        if not launch:
            held.deliver()
            return False
        try:
            self._note_first_scheduled(output, start)
            self._ahead.append(_LaunchedStep(output, handle, finished, start, self._report_state(free_in_step)))
        finally:
            held.deliver()  # the step is committed and in the queue of launched ones
        return True

    def _finish_oldest(self) -> StepReport:
        """Read the oldest launched step's tokens, put them in place, report the step."""
        step, runner = self._ahead[0], cast(AsyncRunner, self.runner)
        sampled = [] if step.handle is None else runner.collect(step.handle)
        ready = None if step.handle is None else runner.ready_time(step.handle)
        end = self.clock() if ready is None else ready  # not the next step's time, which may have run since
        self._held.hold()
        try:
            kept, stopped = self.scheduler.resolve(step.output, sampled, end)  # all or nothing, and then committed
            self._ahead.popleft()
            # What stopped requests gave back goes to the next report: its step had already claimed its own blocks.
            later = self._ahead[0] if self._ahead else step
            self._note_given_back(later)
            if stopped and later is not step:  # reported now, not when the next step's commit finished them
                later.finished[:] = [r for r in later.finished if r not in stopped]
                later.output.preempted[:] = [r for r in later.output.preempted if r not in stopped]
            finished = self._aborted + step.finished + [r for r in stopped if r not in step.finished]
            self._aborted = []
            report = self._report(step.output, kept, finished, step.start, end, step.state)
        except BaseException:
            self._held.deliver()
            raise
        return self._publish_then_deliver(report)

    def _note_given_back(self, step: _LaunchedStep) -> None:
        """Bring ``step``'s report up to now: the block events since the last report, the free blocks and queues.

        A report shows the cache as the learner will next see it, so blocks that a finish gave back appear in the
        report that lists the finish, not one later.
        """
        step.state["block_events"] += self.allocator.drain_events()
        step.state["num_free_blocks"] = self.allocator.num_free_blocks
        step.state["num_running"], step.state["num_waiting"] = len(self.scheduler.running), len(self.scheduler.waiting)

    def _note_first_scheduled(self, output: SchedulerOutput, start: float) -> None:
        for request in output.admitted:
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = start

    def _publish_then_deliver(self, report: StepReport) -> StepReport:
        """Publish a committed step's report, then raise a Ctrl-C held during its commit: the listeners see every
        step, and the hold is released while they run, so a Ctrl-C in one of them acts at once."""
        try:
            self._held.release()
            return self._publish(report)
        finally:
            self._held.deliver()

    def _publish(self, report: StepReport) -> StepReport:
        """Hand the report to every step listener (after the commit: one that raises does not undo the step)."""
        for listener in self.step_listeners:
            listener(report)
        return report

    def generate(
        self,
        prompts: str | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order.

        ``prompts`` is a list of prompts (texts, or sequences of token ids: lists, tuples, numpy arrays, with
        numpy's integers as good as ints); a single text is one prompt. A flat list of ints is refused (wrap it:
        ``[[5, 6, 7]]``), since it could mean one prompt or many.
        ``params`` is one SamplingParams for all prompts or a list with one per prompt. If any prompt is
        invalid, none is queued and nothing is left behind. If anything raises while they run
        (KeyboardInterrupt included), the requests of this call are aborted and dropped from
        ``requests``, their blocks freed, and the exception propagates; the next StepReport lists them
        as aborted, as after ``abort()``, so a widget that saw them run sees them end (an engine ``cut_short``
        is left as it is).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        elif not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        elif prompts and all(as_token_id(p) is not None for p in prompts):  # numpy's integers too
            raise TypeError("prompts is a flat list of ints; pass a list of prompts, e.g. [[5, 6, 7]] for one")
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * len(prompts)
        elif not isinstance(params, (list, tuple)):
            raise TypeError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        self.report_aborts()
        known = set(self.requests)  # what this call adds is cleaned up, an id that never reached ``ids`` included
        ids: list[int] = []
        running, bar = False, None
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.add_request(prompt, p))
            running = True
            bar = progress_bar(len(ids), "generate") if progress else None
            pending = set(ids)
            while pending:
                report = self.step()
                if not (report.scheduled or report.padding or report.finished or report.preempted or self._ahead):
                    raise RuntimeError(
                        "the engine has unfinished requests but scheduled nothing, and the next step would do the"
                        " same: no request can run (a plugged-in scheduler that plans nothing?)"
                    )
                if report.finished:
                    done = pending.intersection(report.finished)
                    pending -= done
                    if bar is not None:
                        bar.update(len(done))
            while self._ahead and not self.scheduler.has_unfinished():  # async: a step launched for stopped requests
                self.step()
            # Not a comprehension: in one, Python 3.13 lets an exception a tracer (a debugger) raises skip the except.
            return list(map(self.release, ids))
        except BaseException:
            # Refused before anything ran, the requests leave no trace; once running, the next StepReport shows
            # them aborted, as engine.abort() does. A second Ctrl-C meanwhile: clean up all the same, then raise.
            while True:
                try:
                    self.forget([i for i in self.requests if i not in known], report=running)
                    break
                except KeyboardInterrupt:
                    continue
            raise
        finally:
            if bar is not None:
                bar.close()

    def forget(self, request_ids: Iterable[int], *, report: bool = True) -> None:
        """Abort these requests where unfinished (freeing their blocks) and drop them from ``requests``: how a run
        cut short cleans up. Ids already released are skipped. ``report=False`` also takes their aborts off the
        next StepReport: nobody ever saw them run. An engine cut short (``cut_short``) is left as it is."""
        if self._held.cut_short:
            return
        request_ids = list(request_ids)
        with self._held_bookkeeping():  # a second Ctrl-C during the clean-up waits for its end
            for request_id in request_ids:
                if request_id in self.scheduler.requests:
                    self.abort(request_id)
                self.requests.pop(request_id, None)
            if not report:
                forgotten = set(request_ids)
                self._aborted = [r for r in self._aborted if r.request_id not in forgotten]

    # ------------------------------------------------------------------ helpers
    def _prompt_token_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids (a text is tokenized), checked against the model's vocabulary and length."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError("prompt is a string but the engine has no tokenizer; pass token ids")
            prompt = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif not is_token_sequence(prompt):
            raise TypeError(f"prompt must be a list of token ids or a string, got {type(prompt).__name__}")
        return prompt_token_ids(prompt, self.runner.vocab_size, self.runner.max_model_len)

    def _report(
        self,
        output: SchedulerOutput,
        sampled: Sequence[int | None],
        finished: list[Request],
        start: float,
        end: float,
        state: dict[str, Any],
    ) -> StepReport:
        """The step's report; ``state`` is what ``_report_state`` said at its commit (async scheduling: updated
        when the tokens were read).

        A sampled token of None (async scheduling: its request had stopped or was aborted) makes its row
        padding: computed and thrown away.
        """
        tokens = iter(sampled)
        scheduled = [
            ScheduledWork(
                c.request.request_id, c.start, c.num_tokens, c.is_prefill, next(tokens) if c.samples else None
            )
            for c in output.chunks
        ]
        padding = [
            ScheduledWork(c.request.request_id, c.start, c.num_tokens, c.is_prefill, None) for c in output.padding
        ]
        if None in sampled:  # only async scheduling drops tokens (Scheduler.resolve)
            dropped = [c.samples and w.token is None for c, w in zip(output.chunks, scheduled, strict=True)]
            padding += [work for work, drop in zip(scheduled, dropped, strict=True) if drop]
            scheduled = [work for work, drop in zip(scheduled, dropped, strict=True) if not drop]
        return StepReport(
            step=output.step,
            start_time=start,
            duration=end - start,
            scheduled=scheduled,
            padding=padding,
            admitted=[r.request_id for r in output.admitted],
            preempted=[r.request_id for r in output.preempted],
            finished={r.request_id: r.finish_reason for r in finished},
            **state,
        )

    def _report_state(self, free_in_step: int) -> dict[str, Any]:
        """The report's block and queue fields, from the allocator and scheduler as they are now."""
        allocator = self.allocator
        return {
            "block_events": allocator.drain_events(),
            "prefix_cache": allocator.drain_prefix_stats() if self.config.enable_prefix_caching else None,
            "num_free_blocks": allocator.num_free_blocks,
            "num_free_blocks_in_step": free_in_step,
            "num_blocks": allocator.num_blocks,
            "block_size": allocator.block_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


@dataclass
class _LaunchedStep:
    """Async scheduling: a step launched and committed with placeholder tokens, its samples not yet read."""

    output: SchedulerOutput
    handle: Any  # the runner's handle on the step's samples (None: the step ran nothing)
    finished: list[Request]  # what its commit finished (by length); a stop found later reports earlier
    start: float
    state: dict[str, Any]  # the report's block and queue fields as its commit left them


def _arrival_time(value: object, now: float) -> float:
    """A finite real number (numpy's included) no later than ``now``, as a float: metrics subtract it from the
    step times, so a time on another clock (``time.time()``) or still to come would make latencies negative."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"arrival_time must be a number (seconds on the engine's clock), got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"arrival_time must be a finite number, got {value}")
    if value > now:
        raise ValueError(
            f"arrival_time ({value}) is later than the engine's clock ({now}): a request arrives when it is added,"
            " or before; times are seconds on engine.clock()"
        )
    return float(value)


def progress_bar(total: int, desc: str) -> Any:
    """A tqdm bar of requests done, updated as they finish; it starts no thread (tqdm's monitor is off for it)."""
    from tqdm.auto import tqdm

    class RequestBar(tqdm):
        monitor_interval = 0  # the monitor thread would outlive the bar, for the rest of the process

    return RequestBar(total=total, desc=desc, unit="req")
