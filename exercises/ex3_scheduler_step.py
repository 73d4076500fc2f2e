"""Exercise 3 · A scheduler step with a token budget: running requests first, then admit and chunk prefills.

Before every model step the scheduler *plans* which requests run and how many tokens each computes.
All of them share one budget, ``self.config.max_batch_tokens``. Fill in ``schedule_continuous``; the
state it reads and the helpers it calls are labkit's (``labkit.core.scheduler.Scheduler``, whose own
``schedule_continuous`` is this exercise's answer: read the helpers, not that method, until you are done):

* ``self.running``: requests in the batch, in admission order; ``self.waiting``: the waiting queue, in arrival
  order except that a preempted request goes back to its front (iterate over it);
* ``self.allocator``: the block allocator (``blocks_needed``, ``can_allocate``, ``allocate``, each taking
  ``request.request_id`` first, and the property ``num_free_blocks``);
* ``request.num_tokens`` (prompt + generated so far) and ``request.num_computed_tokens`` (already in the cache);
* ``output.add_chunk(request, start, n, is_prefill)``: plan the request's tokens ``start .. start + n - 1``;
* ``output.admitted.append(request)``: plan to admit a waiting request;
* ``self.preempt(output, victim)``: plan to evict a running request, freeing its blocks (exercise 4).

A plan changes nothing but the allocator: do not pop from the queues or change requests here; ``update``
applies the plan once the model has run (so a failed step can be rolled back).

Check it: ``labkit check``, ``pytest -m ex3 exercises/``, or ``labkit.exercises.check(3)`` in a notebook;
``labkit check 3 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

from labkit.core.request import RequestState  # noqa: F401 (you will need it)
from labkit.core.scheduler import Scheduler, SchedulerOutput


class MyScheduler(Scheduler):
    def schedule_continuous(self) -> SchedulerOutput:
        """Plan one step: return ``SchedulerOutput(step=self.step_index + 1, chunks=[])`` filled in.

        1. Running requests first, in order, while the budget is positive: each gets ``n = min(remaining,
           budget)`` tokens from ``request.num_computed_tokens`` on, where remaining is ``num_tokens -
           num_computed_tokens`` (1 for a decoding request; ``is_prefill`` is ``request.state is
           RequestState.PREFILLING``; without ``config.chunked_prefill`` remaining is always 1: a whole prompt
           goes in at admission). First make room: while ``allocator.blocks_needed(request.request_id,
           num_computed_tokens + n)`` is more than ``allocator.num_free_blocks``, preempt the youngest running
           request not yet in ``output.preempted`` (``self.preempt(output, victim)``; its blocks are free at
           once). If that victim was this request itself, it gets no chunk: stop the walk there (every younger
           request is preempted already). Otherwise grow its blocks with
           ``allocator.allocate(request.request_id, num_computed_tokens + n)`` and plan its chunk.
        2. Then, unless this step preempted (the victims' blocks are for the running requests, not for a
           newcomer), admit waiting requests from the front, in order, while the budget is positive,
           ``len(self.running) + len(output.admitted) < config.max_num_seqs``, its first chunk fits the budget
           (without chunked prefill the whole ``num_tokens`` must) and the allocator can allocate it. That
           chunk is ``n = min(request.num_tokens, budget)`` tokens from 0 (the whole ``num_tokens`` without
           chunked prefill): a request preempted earlier recomputes its prompt and the tokens it generated,
           not just its prompt. Allocate, then ``output.admitted.append(request)`` and
           ``output.add_chunk(request, 0, n, True)``.
        The chunks never total more than ``config.max_batch_tokens``, and none is empty (0 tokens).

        A step that fails after planning (the model raises) is rolled back, but it may already have written
        keys and values into the blocks its victims gave up: ``self.evict_first`` lists those victims (the
        ``Request`` objects; empty unless the last plan was rolled back), and the ones not finished since
        (``request.state is not RequestState.FINISHED``) are the last of ``self.running``. The walk of item 1
        visits only the running requests before them; after that walk, preempt each of them not yet preempted,
        youngest first (from the end of ``self.running``); such a step admits nothing (item 2 is skipped).
        """
        raise NotImplementedError("Exercise 3")
