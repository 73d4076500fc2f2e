"""A Ctrl-C held while labkit changes its own state, and let through while the model runs.

A step is all or nothing: whatever fails before the scheduler commits is rolled back through the allocator's
journal. But the journal can only undo what it has recorded, and Python may raise a KeyboardInterrupt between any
two statements: between taking a block off the free queue and recording it, say, which would lose the block for
good. So while labkit plans a step, commits it, or adds or aborts a request, a Ctrl-C is held and delivered once the
state is whole. While the model runs, which is most of a step, a Ctrl-C acts at once: the step is rolled back.

Around plugged-in parts (an exercise's allocator, scheduler or queue) only labkit's own code is held: a Ctrl-C that
lands in a learner's code acts at once, which leaves labkit's own parts whole, as they are between two of its calls.
A learner's loop that spends its time in labkit's calls is stopped by a second Ctrl-C: one held that long (labkit's
own code takes microseconds) means the code is stuck.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

STUCK_SECONDS = 0.5  # around a learner's part, a Ctrl-C held this long lets the next one act at once


class HeldInterrupt:
    """Between ``hold()`` and ``release()`` a SIGINT is noted instead of handled, except after ``open()``, which
    lets one act at once until the next ``hold()`` (and acts on one noted before). ``deliver()`` releases and, if
    one came, raises the signal again, so that it does then what it would have done (a KeyboardInterrupt in a
    terminal or a Jupyter kernel); between ``release()`` and ``deliver()`` another acts at once, for both. Python
    runs signal handlers in the main thread only: elsewhere none can land, and nothing is held. A hold costs two
    handler swaps, about 6 us; ``open()`` and a second ``hold()`` cost nothing.

    With ``labkit_code_only``, a SIGINT acts at once where the code running is not labkit's (a learner's part
    plugged in), and so does one that comes ``STUCK_SECONDS`` after one was noted (a way out of code stuck while
    held)."""

    def __init__(self, *, labkit_code_only: bool = False) -> None:
        self._previous: Any = None  # the handler held off (a callable, SIG_DFL or SIG_IGN) while ours is in place
        self._received = False
        self._noted_at = 0.0
        self._open = False
        self._released = False  # released with a SIGINT noted, which waits for deliver(): ours stays in place
        self.labkit_code_only = labkit_code_only

    @property
    def holding(self) -> bool:
        return self._previous is not None and not self._released

    @property
    def pending(self) -> bool:
        """A SIGINT came while held, and waits for ``deliver()``."""
        return self._received

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._released or self._open or (self.labkit_code_only and self._learners_code_runs(frame)):
            self._act(frame)
        elif not self._received:
            self._received, self._noted_at = True, time.monotonic()

    def _learners_code_runs(self, frame: FrameType | None) -> bool:
        """Whether the code that a SIGINT interrupts is a learner's: not labkit's, or stuck since one was noted."""
        stuck = self._received and time.monotonic() - self._noted_at >= STUCK_SECONDS
        return stuck or not _in_labkit(frame)

    def _act(self, frame: FrameType | None) -> None:
        """Let the held-off handler handle a SIGINT now (a KeyboardInterrupt, normally), as if none had been held;
        one noted before is the same Ctrl-C, pressed again. While the model runs (``open()``) the hold stays on,
        closed: the caller rolls the step back, and a second SIGINT meanwhile is noted, not raised in its middle.
        Anywhere else the hold ends here, since no clean-up may follow to end it."""
        previous, self._received = self._previous, False
        if self._open:
            self._open = False
        else:
            self._restore()
        if callable(previous):
            previous(signal.SIGINT, frame)
        elif previous == signal.SIG_DFL:  # the default action, which no Python code can run: raise it for real
            self._restore()
            signal.raise_signal(signal.SIGINT)

    def hold(self) -> None:
        """Hold a SIGINT from now on; after ``open()`` or ``release()``, hold again."""
        self._open = self._released = False
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if previous is None:  # a handler installed outside Python, which could not be put back: leave it be
            return
        self._received = False  # one noted before and never delivered was a Ctrl-C whose KeyboardInterrupt came
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
        """Stop holding. A SIGINT noted meanwhile waits for ``deliver()``: until then our handler stays in place,
        to let one more act at once (the same Ctrl-C, pressed again: only one KeyboardInterrupt comes)."""
        if self._received and self._previous is not None:
            self._open, self._released = False, True
        else:
            self._restore()

    def deliver(self) -> None:
        """Release, and raise a SIGINT that came meanwhile."""
        self._restore()
        if self._received:
            self._received = False
            signal.raise_signal(signal.SIGINT)

    def _restore(self) -> None:
        """Put the held-off handler back. One SIGINT pending as it goes back is handled by ours first."""
        self._open = self._released = False
        previous = self._previous
        if previous is None:
            return
        try:
            signal.signal(signal.SIGINT, previous)
        finally:
            self._previous = None


def _in_labkit(frame: FrameType | None) -> bool:
    """Whether labkit's own code is running in ``frame``: the innermost frame that is not the standard library's,
    nor code it generated (a namedtuple's ``__new__``), nor a tracer's (a debugger's), is labkit's."""
    tracer = getattr(sys.gettrace(), "__code__", None)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        library = module not in sys.modules or module.partition(".")[0] in sys.stdlib_module_names
        if not library and frame.f_code is not tracer:
            return module.partition(".")[0] == "labkit"
        frame = frame.f_back
    return False
