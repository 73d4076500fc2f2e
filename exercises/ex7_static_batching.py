"""Exercise 7 · Static against continuous: the static policy's admission rule, then measure the difference.

Static batching (the classic padded batch) starts a new batch only when the previous one has completely
finished. labkit's ``Scheduler`` calls ``form_static_batch`` at that moment (policy ``"static"``), then
prefills every member, padded to the longest prompt, and decodes them together until the last one is
done. Fill in ``form_static_batch``; the state it uses is labkit's:

* ``self.waiting``: the waiting queue, in arrival order (read it; ``update`` takes the admitted requests off it);
* ``self.allocator.can_allocate(request.request_id, n)`` and ``self.allocator.allocate(request.request_id, n)``;
* ``output.admitted``: the planned batch.

Check it: ``labkit check``, ``pytest -m ex7 exercises/``, or ``labkit.exercises.check(7)`` in a notebook;
``labkit check 7 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

from labkit.core.request import Request
from labkit.core.scheduler import Scheduler, SchedulerOutput


class MyScheduler(Scheduler):
    def form_static_batch(self, output: SchedulerOutput) -> list[Request]:
        """Plan the next static batch from the front of ``self.waiting``, in arrival order; return ``output.admitted``.

        A waiting request joins while all three hold:

        * seats: the batch has fewer than ``self.config.max_num_seqs`` members;
        * budget: the batch is empty, or its padded prompt rows, (members + 1) x the longest prompt including
          this one, stay within ``self.config.max_batch_tokens``. A first member has nothing to pad, so it
          joins even with a prompt longer than the budget (labkit prefills it in chunks);
        * cache, for every member, the first too: its blocks for
          ``request.num_prompt_tokens + request.params.max_new_tokens - 1`` tokens can be reserved up front
          (``self.allocator.can_allocate(request.request_id, n)``).

        Reserve them (``allocate``), then append it to ``output.admitted``. The first request that does not
        fit ends the batch. The ``- 1``: the last generated token is never fed back to the model, so it needs no
        cache slot.
        """
        raise NotImplementedError("Exercise 7")
