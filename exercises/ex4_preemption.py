"""Exercise 4 · Preemption: when the KV cache is full, evict a request and recompute it later, unchanged.

A running request that needs one more block, when none is free, makes the scheduler preempt the
youngest running request (labkit's ``schedule_continuous`` calls ``preempt_one`` until the block fits).
Fill in ``preempt_one``; the state it uses is labkit's (``labkit.core.scheduler.Scheduler``):

* ``self.running``: requests in admission order (the last one is the youngest);
* ``self.waiting``: a deque of requests waiting to be admitted, the front one next;
* ``self.allocator.free(request_id)``: gives a request's blocks back;
* ``request.num_computed_tokens``, ``request.state``, ``request.metrics.num_preemptions``.

Check it: ``labkit check``, ``pytest -m ex4 exercises/``, or ``labkit.exercises.check(4)`` in a notebook.
"""

from __future__ import annotations

from labkit.core.request import Request, RequestState  # noqa: F401 (you will need RequestState)
from labkit.core.scheduler import Scheduler, SchedulerOutput


class MyScheduler(Scheduler):
    def preempt_one(self, output: SchedulerOutput) -> Request:
        """Evict the most recently admitted running request; return it.

        The victim leaves ``self.running`` and gives all its blocks back; its keys and values are gone, so
        its ``num_computed_tokens`` restarts at 0 and its state is ``RequestState.WAITING``. It goes to the
        *front* of ``self.waiting``, is appended to ``output.preempted``, and its
        ``metrics.num_preemptions`` grows by one. Recomputed later from its prompt plus the tokens it has
        already generated, it produces exactly the output it would have without preemption.
        """
        raise NotImplementedError("Exercise 4")
