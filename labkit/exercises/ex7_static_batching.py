"""Checks for exercise 7, the static policy's admission rule (Scheduler.form_static_batch)."""

from __future__ import annotations

from typing import Any

from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.report import StepReport
from labkit.core.scheduler import Scheduler
from labkit.exercises.engine_runs import FIRST_DIFFERENCE_HINT, Workload, config, lockstep, max_seqs_rule
from labkit.exercises.framework import Case, Exercise, property_case

PADDING_HINT = (
    "a static batch is padded to its longest prompt: admit the next request only if the batch is empty or"
    " (members + 1) * max(longest prompt so far, its prompt) <= max_batch_tokens"
)
RESERVE_HINT = (
    "reserve each member's whole future up front: allocator.allocate(request_id,"
    " num_prompt_tokens + params.max_new_tokens - 1) (the last token is never fed back, so it needs no slot)"
)
EXACT_FIT_HINT = (
    "a batch whose padded prompt rows come to exactly max_batch_tokens fits: admit while (members + 1) x the"
    " longest prompt <= max_batch_tokens, and stop only when it is more (>, not >=)"
)
ORDER_HINT = (
    "the first waiting request that does not fit, whether its padded rows or its blocks, ends the batch (break):"
    " never skip ahead of it to a later, smaller one"
)
ALONE_HINT = (
    "the padding rule applies only once the batch has a member: the first request always joins, even a prompt"
    " longer than max_batch_tokens (it has nothing to pad, and labkit prefills it in chunks of the budget);"
    " without that exception it would wait forever"
)
LAST_TOKEN_HINT = (
    "reserve num_prompt_tokens + params.max_new_tokens - 1 tokens, not one more: the last generated token is"
    " returned but never fed back to the model, so no key or value of it is ever written; reserving its slot"
    " too leaves blocks idle that another member could use"
)
SEQS_HINT = "admit only while len(output.admitted) < self.config.max_num_seqs"


def padded_rows_rule(engine: Engine, report: StepReport, cfg: EngineConfig) -> str | None:
    if len(report.admitted) < 2:  # a prompt longer than the budget makes a batch of its own
        return None
    longest = max(engine.requests[i].num_prompt_tokens for i in report.admitted)
    rows = len(report.admitted) * longest
    if rows > cfg.max_batch_tokens:
        return (
            f"step {report.step} forms a batch of {len(report.admitted)} padded to {longest} tokens"
            f" = {rows} rows, but max_batch_tokens is {cfg.max_batch_tokens}"
        )
    return None


def reserve_rule(engine: Engine, report: StepReport, cfg: EngineConfig) -> str | None:
    """A member admitted with fewer blocks than its whole future. Checked before the step is compared with
    labkit's: reserving too little admits more members than fit, and that step's difference is this mistake."""
    allocator = engine.allocator
    for request_id in report.admitted:
        request = engine.requests[request_id]
        if request.is_finished:  # a one-token request: its batch may be over already
            continue
        reserve = request.num_prompt_tokens + request.params.max_new_tokens - 1
        have = len(allocator.block_tables.get(request_id, ())) * allocator.block_size
        if have < reserve:
            return f"r{request_id} was admitted with {have} slots reserved; it may need {reserve}"
    return None


RULES = [(padded_rows_rule, PADDING_HINT), (max_seqs_rule, SEQS_HINT), (reserve_rule, RESERVE_HINT)]


def _case(name: str, workload: Workload, hint: str, **overrides: Any) -> Case:
    cfg = config(policy="static", **overrides)
    return Case(name, lambda cls: lockstep(cls, cfg, workload, hint, RULES), hint)


def _strategy() -> Any:
    from hypothesis import strategies as st

    request = st.tuples(st.integers(1, 12), st.integers(1, 10))
    return st.tuples(
        st.lists(request, min_size=1, max_size=7), st.integers(12, 32), st.integers(1, 4), st.integers(4, 40)
    )


def _property(cls: Any, example: Any) -> None:
    workload, budget, seqs, blocks = example
    cfg = config(policy="static", max_batch_tokens=budget, max_num_seqs=seqs, num_blocks=blocks)
    workload = [(p, n) for p, n in workload if p + n - 1 <= blocks * cfg.block_size] or [(1, 1)]
    hint = FIRST_DIFFERENCE_HINT.format("static policy")
    lockstep(cls, cfg, workload, hint, RULES)


CASES = [
    _case(
        "a batch admits waiting requests in arrival order",
        [(4, 3), (6, 2), (5, 4)],
        "walk self.waiting from the front, in order (do not pop: update() admits the planned batch);"
        " allocate, then output.admitted.append(request); return output.admitted",
    ),
    _case("max_num_seqs caps a batch", [(3, 2)] * 5, SEQS_HINT, max_num_seqs=2),
    _case(
        "a batch's padded prompt rows fit max_batch_tokens",
        [(3, 2), (10, 2), (4, 2), (2, 2)],
        PADDING_HINT,
        max_batch_tokens=24,
    ),
    _case(
        "a batch whose padded rows are exactly max_batch_tokens fits",
        [(6, 2), (6, 2)],
        EXACT_FIT_HINT,
        max_batch_tokens=12,
    ),
    _case(
        "each member reserves its prompt and every token it may generate",
        [(5, 9), (5, 9), (5, 9)],
        RESERVE_HINT,
        num_blocks=9,
    ),
    _case(
        "the last generated token needs no slot",
        [(4, 5), (4, 5), (4, 5)],
        LAST_TOKEN_HINT,
        num_blocks=6,
    ),
    _case(
        "the first request that does not fit ends the batch", [(4, 2), (12, 2), (3, 2)], ORDER_HINT, max_batch_tokens=16
    ),
    _case(
        "the first request whose blocks cannot be reserved ends the batch",
        [(8, 8), (8, 8), (3, 1)],
        ORDER_HINT,
        num_blocks=6,
        max_batch_tokens=64,
    ),
    _case(
        "a first prompt longer than max_batch_tokens forms a batch of its own",
        [(20, 2), (3, 2)],
        ALONE_HINT,
        max_batch_tokens=16,
    ),
    property_case("random workloads form the batches labkit forms", _strategy, _property, max_examples=40),
]

EXERCISE = Exercise(
    number=7,
    after=("02",),
    slug="static_batching",
    title="Static against continuous",
    export="MyScheduler",
    reference=lambda: Scheduler,
    cases=CASES,
    seams=("form_static_batch",),
)
