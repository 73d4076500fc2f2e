"""Exercise 3 · A scheduler step with a token budget: decode first, then admit and chunk prefills.

Before every model step the scheduler decides which requests run and how many tokens each computes.
All of them share one budget, ``self.config.max_batch_tokens``. Fill in ``schedule_continuous``; the
helpers and the state it uses are labkit's (``labkit.core.scheduler.Scheduler``):

* ``self.running``: requests in the batch, in admission order; ``self.waiting``: a deque, in arrival order;
* ``self.allocator``: the block allocator (``blocks_needed``, ``num_free_blocks``, ``can_allocate``, ``allocate``);
* ``request.num_tokens`` (prompt + generated so far) and ``request.num_computed_tokens`` (already in the cache);
* ``self.add_chunk(output, request, n)``: schedule the request's next ``n`` tokens (and count them computed);
* ``self.admit(output, request)``: move a request taken off ``waiting`` into ``running``;
* ``self.preempt_one(output)``: evict the youngest running request and return it (exercise 4).

Check it: ``labkit check``, ``pytest -m ex3 exercises/``, or ``labkit.exercises.check(3)`` in a notebook.
"""

from __future__ import annotations

from labkit.core.request import RequestState  # noqa: F401 (you will need it)
from labkit.core.scheduler import Scheduler, SchedulerOutput


class MyScheduler(Scheduler):
    def schedule_continuous(self) -> SchedulerOutput:
        """Build one step's ``SchedulerOutput(step=self.step_index, chunks=[])`` and return it.

        1. Running requests first, in order: each gets ``min(remaining, budget)`` tokens, where remaining is
           ``num_tokens - num_computed_tokens`` (1 for a decoding request). Without ``config.chunked_prefill``
           a request whose remaining tokens do not fit is skipped this step. Grow its blocks with
           ``allocator.allocate(request_id, num_computed_tokens + n)``; if it needs more blocks than are free,
           call ``self.preempt_one(output)`` until it fits, and stop if it preempted this request itself.
        2. Then, unless this step preempted, admit waiting requests from the front while the budget is
           positive, ``len(self.running) < config.max_num_seqs``, the (possibly chunked) prompt fits and the
           allocator can allocate it: ``popleft``, allocate, ``self.admit``, ``self.add_chunk``.
        The chunks never total more than ``config.max_batch_tokens``.
        """
        raise NotImplementedError("Exercise 3")
