"""Exercise 9 · Who goes first: a ranked waiting queue, shortest-first with ageing.

The scheduler admits from the front of its waiting queue, and the queue decides what "front" means. Under
``EngineConfig(scheduling="shortest-first")`` the request expecting the fewest tokens (prompt +
``max_new_tokens``) goes first, which cuts the mean latency; an ageing term keeps a long request from
starving under a stream of short ones. Each request gets a key when it arrives and keeps it while it lives:

    key = (num_prompt_tokens + params.max_new_tokens + self.ageing * step, arrival number)

``step`` is the scheduler's step when the request arrived, so each step a request has waited is worth
``ageing`` tokens of head start over later arrivals; the arrival number (0, 1, 2, ... in the order ``add``
is called) breaks ties, the earlier arrival first. The queue is a list of ``(key, request)`` kept sorted by key
(``bisect.insort(self._entries, (key, request), key=itemgetter(0))``: never compare two requests).

Fill in the methods below; ``__init__`` and the aliases are given. What labkit's scheduler calls, and when:

* ``add(request, step)`` when a request arrives;
* ``iter(queue)`` every step, to plan: it walks the waiting requests in order and takes nothing out;
* ``remove(request)`` when a request is admitted (or aborted while waiting);
* ``requeue(request)`` when a running request is preempted: it waits again, under the key it arrived with;
* ``forget(request)`` when a request finishes;
* ``len(queue)``.

``place``, ``outranks`` and ``preempts`` come from ``FcfsQueue``: shortest-first never displaces a running
request. Plug it into the engine: ``Engine(model, EngineConfig(scheduling="shortest-first"),
scheduler_cls=scheduler_for(MyShortestFirstQueue))`` (``from labkit.exercises.ex9_shortest_first import
scheduler_for``).
Check it: ``labkit check``, ``pytest -m ex9 exercises/``, or ``labkit.exercises.check(9)`` in a notebook;
``labkit check 9 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

import bisect  # noqa: F401 (you will need them)
import itertools
from collections.abc import Iterator
from operator import itemgetter  # noqa: F401

from labkit.core.queues import AGEING, FcfsQueue
from labkit.core.request import Request


class MyShortestFirstQueue(FcfsQueue):
    def __init__(self, ageing: float = AGEING) -> None:
        """Given: the queue's state. Keep it, and use it."""
        self.ageing = ageing  # tokens of head start per step of waiting
        self._entries: list[tuple[tuple[float, ...], Request]] = []  # (key, request), smallest key first
        self._keys: dict[int, tuple[float, ...]] = {}  # request_id -> key, while the request lives
        self._arrivals = itertools.count()  # the arrival numbers that break ties

    def rank(self, request: Request, step: int) -> tuple[float, ...]:
        """A request's rank, arriving at ``step``: a 1-tuple, ``(prompt tokens + max_new_tokens + ageing x
        step,)`` (``request.num_prompt_tokens``, ``request.params.max_new_tokens``)."""
        raise NotImplementedError("Exercise 9")

    def add(self, request: Request, step: int) -> None:
        """A new request: its key is its rank followed by the next arrival number, ``(*self.rank(request,
        step), next(self._arrivals))``. Remember it in ``self._keys`` and insert ``(key, request)`` in order."""
        raise NotImplementedError("Exercise 9")

    def requeue(self, request: Request) -> None:
        """A preempted request waits again: insert it under the key it arrived with, ``self._keys[request.
        request_id]``, arrival number included (not at the front, as first come first served does, and not
        under a new key: it has waited since it arrived)."""
        raise NotImplementedError("Exercise 9")

    appendleft = append = requeue  # given: a ranked queue has no front or back of its own

    def remove(self, request: Request) -> None:
        """Take ``request`` out (admitted, or aborted while waiting): exactly its entry, wherever it is. The
        scheduler removes only requests that wait, and keeps their keys (a removed request may be requeued)."""
        raise NotImplementedError("Exercise 9")

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests, smallest key first, without taking any out: the scheduler walks the queue
        to plan every step and takes out only the ones it admits (``remove``)."""
        raise NotImplementedError("Exercise 9")

    def __len__(self) -> int:
        """How many requests wait."""
        raise NotImplementedError("Exercise 9")

    def forget(self, request: Request) -> None:
        """``request`` finished (it is no longer in the queue): drop its key from ``self._keys``. It may never
        have been given one here, so that is no error."""
        raise NotImplementedError("Exercise 9")
