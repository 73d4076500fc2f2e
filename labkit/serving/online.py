"""The online driver: serve a workload against the engine's clock, so requests arrive while others run.

Offline benchmarks hand the engine every prompt at once; a server instead sees requests trickle in.
Before each step the driver adds every request whose arrival time the clock has passed, then runs one
step. Requests that arrive during a step wait for it to end, and that wait shows up as queue time.
When the engine is idle and the next request is still in the future, the driver waits for it: a
simulated clock jumps forward (the runner's ``wait_until``), a real one sleeps.

Arrival times are seconds from the moment the driver starts; each request's ``arrival_time`` records
its scheduled arrival on the engine's clock, not the moment the driver got round to adding it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from labkit.core.engine import Engine, progress_bar
from labkit.serving.metrics import Run
from labkit.serving.workloads import WorkloadRequest


def run_workload(
    engine: Engine,
    workload: Sequence[WorkloadRequest],
    *,
    ignore_eos: bool = True,
    progress: bool = False,
) -> Run:
    """Serve ``workload`` on ``engine`` in arrival order; return outputs (in workload order) and step reports.

    Each request asks for exactly its ``max_new_tokens`` unless ``ignore_eos=False`` lets EOS end it
    early. With every arrival at 0 this is an offline run. Every request is checked before the first
    one is served, so a bad one (e.g. too long for the model) is refused, named by its place in the
    workload, before anything runs. If anything raises while they run, the requests already added are
    aborted and the error is raised; the engine's next StepReport lists them, or, where the engine serves
    nothing else, a step of their own before the next run's first (``Engine.report_aborts``).
    """
    if isinstance(workload, (str, bytes)) or not isinstance(workload, Sequence):
        raise TypeError(f"workload must be a list of WorkloadRequest, got {type(workload).__name__}")
    if not workload:
        raise ValueError("workload is empty")
    for index, item in enumerate(workload):
        if not isinstance(item, WorkloadRequest):
            raise TypeError(f"workload items must be WorkloadRequest, got {type(item).__name__}")
        try:
            engine.check_request(item.prompt, item.sampling_params(ignore_eos=ignore_eos))
        except (TypeError, ValueError) as error:
            kind = TypeError if isinstance(error, TypeError) else ValueError
            raise kind(f"workload request {index}: {error}") from None
    engine.report_aborts()  # an earlier run cut short: its ends are reported before this run, not in it
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_time)
    known = set(engine.requests)  # what this run adds is cleaned up, an id that never reached ``ids`` included
    start = engine.clock()
    ids = [0] * len(workload)  # by workload index: the request ids
    reports = []
    bar = progress_bar(len(workload), "serve") if progress else None
    try:
        next_index = 0
        while next_index < len(order) or engine.has_unfinished():
            now = engine.clock()
            while next_index < len(order) and start + workload[order[next_index]].arrival_time <= now:
                item = workload[order[next_index]]
                ids[order[next_index]] = engine.add_request(
                    item.prompt,
                    item.sampling_params(ignore_eos=ignore_eos),
                    arrival_time=start + item.arrival_time,
                )
                next_index += 1
            report = engine.step() if engine.has_unfinished() else None
            if report is not None and (report.scheduled or report.padding):
                reports.append(report)
                if bar is not None:
                    bar.update(len(report.finished))
            elif next_index < len(order):
                _wait_until(engine, start + workload[order[next_index]].arrival_time)
            elif engine.has_unfinished():
                raise RuntimeError(
                    "the engine has unfinished requests but scheduled nothing, and the next step would do the"
                    " same: no request can run (a plugged-in scheduler that plans nothing?)"
                )
        # Not a comprehension: in one, Python 3.13 lets an exception a tracer (a debugger) raises skip the except.
        return Run(list(map(engine.release, ids)), reports)
    except BaseException:
        while True:  # a second Ctrl-C meanwhile: clean up all the same, then raise
            try:
                engine.forget([i for i in engine.requests if i not in known])
                break
            except KeyboardInterrupt:
                continue
        raise
    finally:
        if bar is not None:
            bar.close()


def _wait_until(engine: Engine, t: float) -> None:
    """Let the engine's clock reach ``t`` while it has nothing to do."""
    wait_until = getattr(engine.runner, "wait_until", None)
    if wait_until is not None:
        wait_until(t)
        return
    before = engine.clock()
    time.sleep(max(0.0, t - before))
    if engine.clock() == before:
        raise RuntimeError(
            "the runner's clock did not advance while the engine was idle; a runner whose clock is not"
            " wall time needs a wait_until(t) method"
        )
