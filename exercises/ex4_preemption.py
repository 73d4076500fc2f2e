"""Exercise 4 · Preemption: when the KV cache is full, evict a request and recompute it later, unchanged.

A running request that needs one more block, when none is free, makes labkit's ``schedule_continuous``
preempt the youngest running request. A step is a plan and then a commit, so preemption has two halves:

* ``preempt(output, victim)``, while planning: free the victim's blocks and list it in the plan;
* ``requeue_preempted(victim)``, while committing (``update``, after the model ran): the victim waits again.

Fill in both. The state they use is labkit's (``labkit.core.scheduler.Scheduler``, whose own two methods are
this exercise's answer: read its state, not them, until you are done): ``self.allocator.free``,
``self.waiting`` (the waiting queue, the front one next; ``appendleft`` and ``append`` as on a deque),
``victim.num_computed_tokens``, ``victim.state``, ``victim.metrics.num_preemptions``.

Check it: ``labkit check``, ``pytest -m ex4 exercises/``, or ``labkit.exercises.check(4)`` in a notebook;
``labkit check 4 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

from labkit.core.request import Request, RequestState  # noqa: F401 (you will need RequestState)
from labkit.core.scheduler import Scheduler, SchedulerOutput


class MyScheduler(Scheduler):
    def preempt(self, output: SchedulerOutput, victim: Request) -> None:
        """Plan to preempt ``victim``: give all its blocks back to the allocator now, and append it to
        ``output.preempted`` (``update`` then takes the listed victims off the end of ``self.running``).
        Now, not in ``requeue_preempted``: the scheduler preempts so that the running request that needs a
        block gets one in this very step, so the victim's blocks must be free as soon as this returns.

        Change nothing else here, not even the victim: a step that fails after planning is rolled back, and
        only the allocator's changes can be undone. The victim itself changes in ``requeue_preempted``.
        """
        raise NotImplementedError("Exercise 4")

    def requeue_preempted(self, victim: Request) -> None:
        """Commit the preemption: ``victim`` waits again, at the *front* of ``self.waiting``.

        The scheduler has taken it out of ``self.running`` already: put it in the queue, nowhere else.

        Its keys and values are gone with its blocks, so its ``num_computed_tokens`` restarts at 0 and its
        state is ``RequestState.WAITING``; its ``metrics.num_preemptions`` grows by one. It keeps the tokens
        it generated: recomputed from prompt + output, it produces exactly the output it would have had
        without preemption.
        """
        raise NotImplementedError("Exercise 4")
