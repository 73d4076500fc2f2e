"""A Ctrl-C held while labkit changes its own state, and let through while the model runs.

A step is all or nothing: whatever fails before the scheduler commits is rolled back through the allocator's
journal. But the journal can only undo what it has recorded, and Python may raise a KeyboardInterrupt between any
two statements: between taking a block off the free queue and recording it, say, which would lose the block for
good. So while labkit plans a step, commits it, or adds or aborts a request, a Ctrl-C is held and delivered once the
state is whole. While the model runs, which is most of a step, a Ctrl-C acts at once: the step is rolled back.

Around a learner's plugged-in scheduler or queue, a Ctrl-C that lands in the learner's code while a step is planned
acts at once too: that planning is rolled back whatever they raise. Everywhere else (a learner's allocator or cache,
whose changes the rollback knows only as far as they record them; the commit, adding, aborting, cleaning up, where
labkit's state is half changed while it calls the learner's code) a Ctrl-C waits. One that has waited
``STUCK_SECONDS`` means the code is stuck (a loop that spends its time in labkit's calls, say): the next acts at once
wherever it lands, and the engine, cut short, refuses to go on.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Collection
from types import CodeType, FrameType
from typing import Any

STUCK_SECONDS = 0.5  # with ``way_out``, a Ctrl-C held this long lets the next one act at once


class HeldInterrupt:
    """Between ``hold()`` and ``release()`` a SIGINT is noted instead of handled, except after ``open()``, which
    lets one act at once until the next ``hold()`` (and acts on one noted before). ``deliver()`` releases and, if
    one came, raises the signal again, so that it does then what it would have done (a KeyboardInterrupt in a
    terminal or a Jupyter kernel); between ``release()`` and ``deliver()`` another acts at once, for both. Python
    runs signal handlers in the main thread only: elsewhere none can land, and nothing is held. A hold costs two
    handler swaps, about 7 us; ``open()`` and a second ``hold()`` cost nothing.

    In a hold with ``learners_code_acts``, a SIGINT that lands in code of ``acts_in`` acts at once, unless code of
    ``waits_in`` or labkit's own runs inside it. With ``way_out``, one that comes ``STUCK_SECONDS`` after one was
    noted acts at once, and sets ``cut_short``."""

    def __init__(
        self, *, acts_in: Collection[CodeType] = (), waits_in: Collection[CodeType] = (), way_out: bool = False
    ) -> None:
        self._previous: Any = None  # the handler held off (a callable, SIG_DFL or SIG_IGN) while ours is in place
        self._received = False
        self._noted_at = 0.0
        self._open = False
        self._released = False  # released with a SIGINT noted, which waits for deliver(): ours stays in place
        self._learners_code_acts = False
        self.acts_in, self.waits_in, self.way_out = frozenset(acts_in), frozenset(waits_in), way_out
        self.cut_short = False  # a SIGINT acted in the middle of a held change: the state may not add up

    @property
    def holding(self) -> bool:
        return self._previous is not None and not self._released

    @property
    def pending(self) -> bool:
        """A SIGINT came while held, and waits for ``deliver()``."""
        return self._received

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self._previous is None:  # left installed by someone else's restore (a debugger's): act as Python's own
            signal.default_int_handler(signum, frame)
        elif self._released or self._open or self._in_learners_turn(frame):
            self._act(frame)
        elif self.way_out and self._received and time.monotonic() - self._noted_at >= STUCK_SECONDS:
            self.cut_short = True  # the way out of a stuck loop, at the cost of the engine
            self._act(frame)
        elif not self._received:
            self._received, self._noted_at = True, time.monotonic()

    def _in_learners_turn(self, frame: FrameType | None) -> bool:
        """Whether a SIGINT landed in a learner's scheduler or queue while a step is planned."""
        return self._learners_code_acts and _acts_here(frame, self.acts_in, self.waits_in)

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

    def hold(self, *, learners_code_acts: bool = False) -> None:
        """Hold a SIGINT from now on; after ``open()`` or ``release()``, hold again. ``learners_code_acts``: let
        one that lands in a learner's part act at once (while a step is planned, which is rolled back whatever)."""
        self._open = self._released = False
        self._learners_code_acts = learners_code_acts
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if previous is None:  # a handler installed outside Python, which could not be put back: leave it be
            return
        if getattr(previous, "__func__", None) is HeldInterrupt._note:  # one a debugger put back: Python's own
            previous = signal.default_int_handler
        self._received = False  # one noted before and never delivered was a Ctrl-C whose KeyboardInterrupt came
        self._previous = previous  # before the swap: a SIGINT right after it is ours, and noted
        try:
            signal.signal(signal.SIGINT, self._note)
        except BaseException:  # one pending was handled by the handler still in place
            self._previous = None
            raise

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
        """Put the held-off handler back, unless someone has put their own in ours' place meanwhile (a debugger,
        which puts ours back later: it then acts as Python's own). One SIGINT pending as it goes back is handled by
        ours first."""
        self._open = self._released = False
        previous = self._previous
        if previous is None:
            return
        try:
            replaced = signal.signal(signal.SIGINT, previous)
            if replaced is not None and replaced != self._note:  # someone else's, installed meanwhile: theirs stays
                signal.signal(signal.SIGINT, replaced)
        finally:
            self._previous = None


def _acts_here(frame: FrameType | None, acts_in: frozenset[CodeType], waits_in: frozenset[CodeType]) -> bool:
    """Whether the innermost frame that runs code of ``acts_in``, of ``waits_in`` or of labkit is one of ``acts_in``
    (frames of the libraries they call, of helpers, of a tracer (a debugger), are passed over)."""
    tracer = getattr(sys.gettrace(), "__code__", None)
    while frame is not None:
        code = frame.f_code
        if code in acts_in and code is not tracer:
            return True
        module = frame.f_globals.get("__name__", "")
        if code in waits_in or module == "labkit" or module.startswith("labkit."):
            return False
        frame = frame.f_back
    return False
