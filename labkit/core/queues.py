"""Who goes first: the waiting queue's order, one small class per scheduling policy.

The scheduler admits from the front of its waiting queue; the queue decides what "front" means
(``EngineConfig(scheduling=...)``):

* ``"fcfs"`` - first come, first served. A preempted request goes back to the very front: it was
  admitted before anyone still waiting.
* ``"priority"`` - lowest ``SamplingParams.priority`` first, then arrival. Running requests are kept in
  the same order, so the last one is the lowest-ranked: the one preempted first, and the one a better
  waiting request may displace (``preempts = True``) when the engine is full.
* ``"shortest-first"`` - fewest expected tokens (prompt + ``max_new_tokens``, a cap: the order is only as
  good as the caps are honest) first, which cuts the mean latency, but would let a steady stream of short
  requests starve a long one. Ageing prevents that: the key is ``expected tokens + ageing x arrival step``,
  so each step a request has waited is worth ``ageing`` tokens of head start over later arrivals. A request
  expecting ``E`` tokens, arriving at step ``t``, ranks before every request arriving after step
  ``t + (E - 1) / ageing``: only finitely many can pass it. The key never changes while a request waits, so
  the queue stays sorted as it is.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterator
from operator import itemgetter

from labkit.core.request import Request

AGEING = 8  # shortest-first: tokens of head start per step of waiting


class FcfsQueue:
    """First come, first served: a deque, with preempted requests put back in front.

    The scheduler plans a step by iterating over the queue in order, without taking anything out; the
    step's commit then puts the preempted requests back (``requeue``) and takes the admitted ones out
    (``remove``: they were at the front before the preempted ones went back).
    """

    preempts = False  # a waiting request never displaces a running one

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def add(self, request: Request, step: int) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        """Put a preempted request back: first in line."""
        self._queue.appendleft(request)

    appendleft = requeue  # as on a deque: the scheduler's exercises treat the queue as one

    def append(self, request: Request) -> None:
        """Put a request last in line, as on a deque."""
        self._queue.append(request)

    def popleft(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def forget(self, request: Request) -> None:
        """The request finished: drop whatever the queue remembers about it."""

    def place(self, running: list[Request], request: Request) -> None:
        """Add a newly admitted request to the running list: last, so it is the first to be preempted."""
        running.append(request)

    def outranks(self, waiting: Request, running: Request) -> bool:
        return False


class RankedQueue(FcfsQueue):
    """Kept sorted by ``rank(request, step)``, ties broken by arrival; a request keeps its key while it lives.

    A sorted list rather than a heap: planning walks the queue in order every step, and inserting into
    a list of a few thousand requests is a fast memory move.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[tuple[float, ...], Request]] = []  # (key, request), smallest key first
        self._keys: dict[int, tuple[float, ...]] = {}
        self._arrivals = itertools.count()

    def rank(self, request: Request, step: int) -> tuple[float, ...]:
        raise NotImplementedError

    def key(self, request: Request) -> tuple[float, ...]:
        return self._keys[request.request_id]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in self._entries)

    def add(self, request: Request, step: int) -> None:
        key = (*self.rank(request, step), next(self._arrivals))  # unique: requests are never compared
        self._keys[request.request_id] = key
        bisect.insort(self._entries, (key, request), key=itemgetter(0))

    def requeue(self, request: Request) -> None:
        """Put a preempted request back where its key ranks it."""
        bisect.insort(self._entries, (self.key(request), request), key=itemgetter(0))

    appendleft = append = requeue  # a ranked queue has no front or back of its own: the key places a request

    def popleft(self) -> Request:
        return self._entries.pop(0)[1]

    def remove(self, request: Request) -> None:
        self._entries.remove((self.key(request), request))

    def forget(self, request: Request) -> None:
        self._keys.pop(request.request_id, None)


class PriorityQueue(RankedQueue):
    """Lowest ``priority`` first; running requests are kept in rank order and may be displaced."""

    preempts = True

    def rank(self, request: Request, step: int) -> tuple[float, ...]:
        return (request.params.priority,)

    def place(self, running: list[Request], request: Request) -> None:
        bisect.insort(running, request, key=self.key)

    def outranks(self, waiting: Request, running: Request) -> bool:
        return self.key(waiting) < self.key(running)


class ShortestFirstQueue(RankedQueue):
    """Fewest expected tokens first, with ``ageing`` tokens of head start per step waited (see the module).

    Exercise 9 has the learner write it; ``labkit.exercises.ex9_shortest_first.scheduler_for`` plugs a queue class
    into the engine's scheduler."""

    def __init__(self, ageing: float = AGEING) -> None:
        super().__init__()
        self.ageing = ageing

    def rank(self, request: Request, step: int) -> tuple[float, ...]:
        return (request.num_prompt_tokens + request.params.max_new_tokens + self.ageing * step,)


QUEUES = {"fcfs": FcfsQueue, "priority": PriorityQueue, "shortest-first": ShortestFirstQueue}
