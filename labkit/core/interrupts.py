"""A Ctrl-C held while labkit changes its own state, and let through while the model runs.

A step is all or nothing: whatever fails before the scheduler commits is rolled back through the allocator's
journal. But the journal can only undo what it has recorded, and Python may raise a KeyboardInterrupt between any
two statements: between taking a block off the free queue and recording it, say, which would lose the block for
good. So while labkit plans a step, commits it, or adds or aborts a request, a Ctrl-C is held and delivered once the
state is whole. While the model runs, which is most of a step, a Ctrl-C acts at once: the step is rolled back.

Plugged-in parts (an exercise's allocator, scheduler or queue) are never planned with a Ctrl-C held, and around them
a second Ctrl-C acts at once even in the commit: a learner's code stuck in a loop must stay interruptible.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class HeldInterrupt:
    """Between ``hold()`` and ``release()`` a SIGINT is noted instead of handled, except after ``open()``, which
    lets one act at once until the next ``hold()`` (and acts on one noted before). ``deliver()`` releases and, if
    one came, raises the signal again, so that it does then what it would have done (a KeyboardInterrupt in a
    terminal or a Jupyter kernel). Python runs signal handlers in the main thread only: elsewhere none can land, and
    nothing is held. A hold costs two handler swaps, about 6 us; ``open()`` and a second ``hold()`` cost nothing.
    With ``second_acts``, a second SIGINT while one is noted acts at once (a way out of code stuck while held)."""

    def __init__(self, *, second_acts: bool = False) -> None:
        self._previous: Any = None  # the handler held off: a callable, SIG_DFL or SIG_IGN
        self._received = False
        self._open = False
        self.second_acts = second_acts

    @property
    def holding(self) -> bool:
        return self._previous is not None

    @property
    def pending(self) -> bool:
        """A SIGINT came while held, and waits for ``deliver()``."""
        return self._received

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._open or (self._received and self.second_acts):
            self._act(frame)
        else:
            self._received = True

    def _act(self, frame: FrameType | None) -> None:
        """Let the held-off handler handle a SIGINT now (a KeyboardInterrupt, normally), as if none had been held.
        The hold stays on, closed: a second SIGINT while the caller cleans up is noted, not raised in the middle."""
        self._received, self._open = False, False
        previous = self._previous
        if callable(previous):
            previous(signal.SIGINT, frame)
        elif previous == signal.SIG_DFL:  # the default action, which no Python code can run: raise it for real
            self.release()
            signal.raise_signal(signal.SIGINT)

    def hold(self) -> None:
        """Hold a SIGINT from now on; after ``open()``, hold again."""
        self._open = False
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if previous is None:  # a handler installed outside Python, which could not be put back: leave it be
            return
        signal.signal(signal.SIGINT, self._note)
        self._previous = previous

    def open(self) -> None:
        """While held, let a SIGINT act at once until the next ``hold()``; one noted meanwhile acts now."""
        if self._previous is None:
            return
        self._open = True
        if self._received:
            self._act(None)

    def release(self) -> None:
        """Put the handler back, keeping a SIGINT that came for ``deliver()``."""
        previous, self._previous = self._previous, None
        self._open = False
        if previous is not None:
            signal.signal(signal.SIGINT, previous)

    def deliver(self) -> None:
        """Release, and raise a SIGINT that came meanwhile."""
        self.release()
        if self._received:
            self._received = False
            signal.raise_signal(signal.SIGINT)
