"""A Ctrl-C held while a step commits.

A step is all or nothing: whatever fails before the scheduler commits is rolled back. From the commit on, the plan
is applied with plain assignments (queues, computed tokens, new tokens, the engine's list of launched steps) that
must all happen: a KeyboardInterrupt between two of them would leave requests, queues and blocks disagreeing, and
every later step failing. So a Ctrl-C that arrives there is held, and delivered once the step is whole.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class HeldInterrupt:
    """Between ``hold()`` and ``release()`` a SIGINT is noted instead of handled. ``deliver()`` releases it and, if
    one came, raises the signal again, so that it does then what it would have done (a KeyboardInterrupt in a
    terminal or a Jupyter kernel); between the two, the step's report goes to its listeners with the handler back in
    place. Python runs signal handlers in the main thread only: elsewhere none can land, and nothing is held. The
    two handler swaps cost about 6 us a step."""

    def __init__(self) -> None:
        self._previous: Any = None  # the handler held off: a callable, SIG_DFL or SIG_IGN
        self._received = False

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._received = True

    def hold(self) -> None:
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if previous is None:  # a handler installed outside Python, which could not be put back: leave it be
            return
        signal.signal(signal.SIGINT, self._note)
        self._previous = previous

    def release(self) -> None:
        """Put the handler back, keeping a SIGINT that came for ``deliver()``."""
        previous, self._previous = self._previous, None
        if previous is not None:
            signal.signal(signal.SIGINT, previous)

    def deliver(self) -> None:
        """Release, and raise a SIGINT that came meanwhile."""
        self.release()
        if self._received:
            self._received = False
            signal.raise_signal(signal.SIGINT)
