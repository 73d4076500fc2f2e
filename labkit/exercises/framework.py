"""How an exercise is checked: cases that raise a Mismatch, run against an implementation, turned into feedback.

An :class:`Exercise` is a number, a title, the name the learner's file exports, labkit's own implementation
(the reference) and a list of :class:`Case`. A case calls the implementation and raises :class:`Mismatch`
with the input, what was expected, what came back and a hint. A property case draws its inputs with
hypothesis, which shrinks a failure to the smallest counterexample before it is reported. A
NotImplementedError means "not started"; any other exception is the learner's own error, shown with the
frames of the learner's code only (``verbose=True`` shows the whole traceback).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import labkit

LABKIT_DIR = Path(labkit.__file__).resolve().parent
#: Where the learner's files are looked for when no path is given (besides ./exercises and .).
EXERCISES_DIR_ENV = "LABKIT_EXERCISES_DIR"
MAX_SHOWN = 600  # characters of one input/expected/got field
# A case runs labkit's own code in well under a second; a learner's code that runs this long is stopped (an endless
# loop would otherwise hang the check, and an instructor's run over a class's files with it), and the exercise's
# later cases are not run.
CASE_SECONDS = 60.0


class Mismatch(AssertionError):
    """A case's verdict: the implementation did something other than the contract says."""

    def __init__(self, input: str, expected: str, got: str, hint: str = "") -> None:
        super().__init__(f"expected {expected}, got {got}")
        self.input, self.expected, self.got, self.hint = input, expected, got, hint


_current_input = [""]  # what the running case last handed to the learner's code, shown if that code raises


def showing(input: str) -> None:
    """Record the input a case is about to pass to the learner's code: an exception there is shown with it."""
    _current_input[0] = input


def shown() -> str:
    """The input last recorded with :func:`showing`: for a Mismatch raised by a helper that does not know it."""
    return _current_input[0]


@dataclass(frozen=True)
class Case:
    """One check: ``run(implementation)`` returns when the implementation meets this part of the contract."""

    name: str
    run: Callable[[Any], None]
    hint: str = ""  # shown when the case fails without a hint of its own (e.g. the learner's code raised)


def property_case(
    name: str, strategy: Callable[[], Any], test: Callable[[Any, Any], None], *, max_examples: int = 60, hint: str = ""
) -> Case:
    """A case that runs ``test(implementation, example)`` on examples drawn from the hypothesis ``strategy()``.

    hypothesis shrinks a failing example before the Mismatch is re-raised, so the learner sees the
    smallest input that breaks their code, marked as a counterexample.
    """

    hint = hint or PROPERTY_HINT

    def run(implementation: Any) -> None:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings

        @settings(
            max_examples=max_examples,
            database=None,
            derandomize=True,
            deadline=None,
            verbosity=Verbosity.quiet,
            report_multiple_bugs=False,
            print_blob=False,
            phases=[Phase.explicit, Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )
        @given(strategy())
        def check(example: Any) -> None:
            test(implementation, example)

        try:
            check()
        except Mismatch as mismatch:
            mismatch.input = f"{mismatch.input}\n(the smallest counterexample hypothesis found)"
            raise
        except Exception as error:
            if not _is_flaky(error):
                raise
            raise Mismatch(
                _current_input[0],
                "the same answer each time the same input is given",
                "an answer that failed once and passed when hypothesis tried the same input again",
                FLAKY_HINT,
            ) from None

    return Case(name, run, hint)


PROPERTY_HINT = (
    "the input above is the smallest one hypothesis found, among inputs drawn at random, on which your code goes"
    " wrong; the cases above it check one rule each, and the first of them that fails is the place to start"
)
FLAKY_HINT = (
    "your code answers the same input differently from one call to the next: its answer must depend on its"
    " arguments only (a shared random generator such as torch.rand, or state kept between calls, breaks that)"
)


def _is_flaky(error: BaseException) -> bool:
    """Whether hypothesis gave up because a failing example passed when run again (its Flaky errors)."""
    from hypothesis import errors

    flaky = tuple(getattr(errors, name) for name in ("Flaky", "FlakyFailure") if hasattr(errors, name))
    return isinstance(error, flaky)


@dataclass(frozen=True)
class Exercise:
    number: int
    after: tuple[str, ...]  # the course notebooks that come before it ("03" for notebooks/03_*.ipynb)
    slug: str  # the learner's file is exercises/ex{number}_{slug}.py
    title: str
    export: str  # the name that file defines: the implementation
    reference: Callable[[], Any]  # labkit's own implementation, imported when asked for
    cases: Sequence[Case]
    seams: tuple[str, ...] = ()  # the methods the export, a subclass of labkit's class, defines (none: a function)

    @property
    def filename(self) -> str:
        return f"ex{self.number}_{self.slug}.py"

    @property
    def course_position(self) -> tuple[str, int]:
        """Where it comes in the course: after its last notebook, in number order among those after the same one."""
        return self.after[-1], self.number


@dataclass
class Failure:
    """One failing case, in words. ``kind`` is "mismatch", "error" (the code raised), "out of time" (it ran past
    CASE_SECONDS), "stopped" (a Ctrl-C, or a notebook's stop button, while it ran) or "not started"."""

    case: str
    kind: str
    input: str = ""
    expected: str = ""
    got: str = ""
    hint: str = ""
    traceback: str = ""

    def message(self) -> str:
        if self.kind == "not started":  # ``got`` names the method that still raises, where one is known
            return f"· {self.case}: not started: {self.got or 'raises NotImplementedError'}"
        lines = [f"✗ {self.case}"]
        for label, text in (("input", self.input), ("expected", self.expected), ("got", self.got)):
            if text:
                lines.append(_field(label, text))
        if self.traceback:
            lines.append(_field("where", self.traceback))
        if self.hint:
            lines.append(_field("hint", self.hint))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, str]:
        return dict(vars(self))


@dataclass
class CheckResult:
    """What :func:`labkit.exercises.check` found. ``passed`` is True when every case passes."""

    number: int
    title: str
    source: str  # where the implementation came from
    num_cases: int
    failures: list[Failure] = field(default_factory=list)
    implementation: Any = None
    load_error: str = ""  # the learner's file could not be found or imported

    @property
    def passed(self) -> bool:
        return not self.load_error and not self.failures

    @property
    def num_passed(self) -> int:
        return 0 if self.load_error else self.num_cases - len(self.failures)

    @property
    def status(self) -> str:
        """ "passed", "failing", "not started" (every case raised NotImplementedError, or the file hands in
        labkit's own code) or "no file" (none where the check looked)."""
        if self.passed:
            return "passed"
        if self.load_error.startswith("no file"):
            return "no file"
        if self.load_error.startswith(NOT_WRITTEN) or (
            self.failures
            and len(self.failures) == self.num_cases
            and all(f.kind == "not started" for f in self.failures)
        ):
            return "not started"
        return "failing"

    def report(self) -> str:
        head = f"Exercise {self.number} · {self.title} ({self.source})"
        if self.load_error:
            return f"{head}\n{self.load_error}"
        if self.passed:
            return f"{head}\n✓ all {self.num_cases} checks pass"
        if self.status == "not started":
            return (
                f'{head}\nnot started: every check raises NotImplementedError("Exercise {self.number}").'
                f" Fill in the stubs, then check again ({self.num_cases} checks wait)."
            )
        parts = [f"{head}\n{self.num_passed} of {self.num_cases} checks pass"]
        parts += [f.message() for f in self.failures if f.kind != "not started"]
        waiting = [f.message() for f in self.failures if f.kind == "not started"]
        return "\n\n".join(parts + (["\n".join(waiting)] if waiting else []))

    def to_dict(self) -> dict[str, Any]:
        return {
            "exercise": self.number,
            "title": self.title,
            "status": self.status,
            "passed": self.num_passed,
            "cases": self.num_cases,
            "source": self.source,
            "error": self.load_error,
            "failures": [f.to_dict() for f in self.failures],
        }

    def __repr__(self) -> str:
        return f"CheckResult(exercise={self.number}, status={self.status!r}, passed={self.num_passed}/{self.num_cases})"


class OutOfTime(BaseException):
    """Raised into a case that ran past CASE_SECONDS. Not an Exception: a learner's ``except Exception`` must not
    swallow it."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise OutOfTime in the code run inside, once it has run ``seconds``: by SIGALRM, so only in the main
    thread of a Unix process (a terminal, pytest, a Jupyter kernel); elsewhere there is no limit."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise OutOfTime

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_case(case: Case, implementation: Any, *, verbose: bool = False) -> Failure | None:
    """Run one case, for at most CASE_SECONDS; None when it passes."""
    _current_input[0] = ""
    try:
        with time_limit(CASE_SECONDS):
            case.run(implementation)
    except (OutOfTime, KeyboardInterrupt) as stopped:
        if isinstance(stopped, OutOfTime):
            kind, got = "out of time", f"your code was still running after {CASE_SECONDS:.0f} s, and was stopped"
        else:  # the learner stopped a check that seemed to hang: where it was is what they need to see
            kind, got = "stopped", "you stopped the check (Ctrl-C, or the notebook's stop button) while this case ran"
        hint = "a loop that never ends? Look for a while loop whose condition nothing in it changes"
        where = learner_frames(stopped)  # the line it was running when stopped
        shown = _clip(_current_input[0], 2 * MAX_SHOWN)
        return Failure(case.name, kind, shown, got=got, hint=hint, traceback=where)
    except NotImplementedError as error:
        return Failure(case.name, "not started", got=_not_started(error))
    except Mismatch as mismatch:
        return Failure(
            case.name,
            "mismatch",
            _clip(mismatch.input, 2 * MAX_SHOWN),
            _clip(mismatch.expected),
            _clip(mismatch.got),
            mismatch.hint or case.hint,
            traceback.format_exc() if verbose else "",
        )
    except (Exception, SystemExit) as error:  # the learner's own error (sys.exit() too): show it, not labkit's
        where = traceback.format_exc() if verbose else learner_frames(error) or _raised_outside(error)
        got = f"your code raised {type(error).__name__}: {error}"
        hint = _error_hint(error, case.hint)
        return Failure(
            case.name, "error", _clip(_current_input[0], 2 * MAX_SHOWN), got=_clip(got), hint=hint, traceback=where
        )
    return None


def _raised_outside(error: BaseException) -> str:
    """Where an error came from that no frame of the learner's code raised: labkit's code, working on what the
    learner's code returned or changed (a bytearray used as a dict key, a queue whose len() is a str)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    if Path(last.filename).resolve().is_relative_to(LABKIT_DIR / "exercises"):
        return "not in your code: the check raised it, on what your code returned (the input's last line)"
    return (
        f"not in your code: labkit's {last.name}() ({Path(last.filename).name}) raised it, working on what your"
        " code returned or changed"
    )


def _not_started(error: NotImplementedError) -> str:
    """Which of the learner's functions still raises NotImplementedError ("free() still raises ..."): in an
    exercise with two methods, where one is done, the other is the one to fill in. "" when none of the frames is
    the learner's."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if _is_learner(frame)]
    return f"{frames[-1].name}() still raises NotImplementedError" if frames else ""


def _broken_code_hint(error: BaseException) -> str:
    """For an error that says the code cannot run at all (a misspelt name, a missing attribute), raised in the
    learner's own code: a hint naming where, instead of the case's, which is about what the code should do."""
    frames = traceback.extract_tb(error.__traceback__)
    if not isinstance(error, (AttributeError, NameError, ImportError)) or not frames or not _is_learner(frames[-1]):
        return ""
    return (
        f"{type(error).__name__} in your {frames[-1].name}() (line {frames[-1].lineno}, shown under where):"
        " this case could not check anything, because the code stops there; fix that line and check again"
    )


def _error_hint(error: BaseException, case_hint: str) -> str:
    """The hint for a case whose run raised: where the code stopped, if it is broken there, then the case's."""
    broken = _broken_code_hint(error)
    if broken and case_hint:
        return f"{broken}. What this case checks: {case_hint}"
    return broken or case_hint


def run_exercise(
    exercise: Exercise, implementation: Any, source: str, *, verbose: bool = False, cases: Sequence[str] | None = None
) -> CheckResult:
    chosen = [c for c in exercise.cases if cases is None or c.name in cases]
    result = CheckResult(exercise.number, exercise.title, source, len(chosen), implementation=implementation)
    # A case ran out of time, or the learner stopped it: the cases after it are not run (each would wait as long).
    stopped_by = None
    for case in chosen:
        if stopped_by is not None:
            failure: Failure | None = Failure(case.name, "error", got=f"not run: a check before it {stopped_by}")
        else:
            failure = run_case(case, implementation, verbose=verbose)
            if failure is not None and failure.kind in ("out of time", "stopped"):
                stopped_by = "ran out of time" if failure.kind == "out of time" else "was stopped"
        if failure is not None:
            result.failures.append(failure)
    return result


def learner_frames(error: BaseException) -> str:
    """The traceback frames outside labkit, the standard library and installed packages: the learner's code."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _is_learner(f)]
    return "".join(traceback.format_list(frames)).rstrip()


def _is_learner(frame: traceback.FrameSummary) -> bool:
    """Whether a frame is the learner's: a notebook cell, or a file outside labkit and the environment.

    Code without a file (``<string>``, ``<frozen importlib._bootstrap>``, a dataclass's generated methods) is
    not, except an IPython cell (``<ipython-input-...>``; newer IPython gives cells real file names).
    """
    name = frame.filename
    if "hypothesis" in name or (name.startswith("<") and not name.startswith("<ipython-input")):
        return False
    library_dirs = {str(Path(p).resolve()) for p in (sys.prefix, sys.base_prefix)} | {str(LABKIT_DIR)}
    return name.startswith("<") or not any(str(Path(name).resolve()).startswith(d) for d in library_dirs)


# ---------------------------------------------------------------------- the learner's file
NOT_WRITTEN = "not written"  # how a load error starts when the file hands in labkit's own code for the exercise


def labkit_parts(exercise: Exercise, implementation: Any) -> list[str]:
    """The parts of ``exercise`` that ``implementation`` takes from labkit instead of defining: labkit's own
    function, or seams its class inherits from labkit's (a subclass with ``pass`` for a body passes every check)."""
    if not exercise.seams:
        return [f"{exercise.export}()"] if _is_labkit(implementation) else []
    if not isinstance(implementation, type):  # not a class at all: the checks say what goes wrong
        return []
    parts = []
    for name in exercise.seams:
        definer = next((c for c in inspect.getmro(implementation) if name in vars(c)), None)
        if definer is None or _is_labkit(definer):
            parts.append(f"{name}()")
    return parts


def labkit_parts_error(exercise: Exercise, parts: Sequence[str]) -> str:
    """The load error of a file that hands in labkit's own ``parts``: "not written" when that is all of them."""
    them = "it" if len(parts) == 1 else "them"
    lead = NOT_WRITTEN if len(parts) == max(1, len(exercise.seams)) else "incomplete"
    return (
        f"{lead}: your file takes {' and '.join(parts)} from labkit instead of defining {them}, and labkit's code"
        f" passes every check, so the checks would say nothing about yours. Write {them} in {exercise.filename}."
    )


def _is_labkit(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "labkit" or module.startswith("labkit.")


def find_learner_file(exercise: Exercise, path: str | os.PathLike[str] | None = None) -> Path | None:
    """``path`` (a file, its folder, or a copy of the repository holding it in exercises/), else
    $LABKIT_EXERCISES_DIR, ./exercises, . and the repo's exercises/."""
    if path is not None:
        candidate = Path(path)
        if not candidate.is_dir():
            return candidate
        direct, nested = candidate / exercise.filename, candidate / "exercises" / exercise.filename
        return nested if nested.is_file() and not direct.exists() else direct  # nested: a whole checkout handed in
    folders = [Path(os.environ[EXERCISES_DIR_ENV])] if os.environ.get(EXERCISES_DIR_ENV) else []
    folders += [Path.cwd() / "exercises", Path.cwd(), LABKIT_DIR.parent / "exercises"]
    for folder in folders:
        if (folder / exercise.filename).is_file():
            return folder / exercise.filename
    return None


def load_learner(exercise: Exercise, file: Path) -> Any:
    """Import the learner's file afresh (edits since the last check count) and return what it exports."""
    name = f"labkit_learner_ex{exercise.number}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # Compiled from the source each time, never from a cached .pyc: that one is matched to the file by its size and
    # its modification time in whole seconds, so a second save of the same length within a second would run the
    # version saved before it.
    exec(compile(file.read_bytes(), str(file), "exec"), module.__dict__)
    if not hasattr(module, exercise.export):
        raise AttributeError(f"{file.name} defines no {exercise.export!r}")
    return getattr(module, exercise.export)


def _field(label: str, text: str) -> str:
    pad = " " * 12
    first, *rest = text.splitlines() or [""]
    return f"  {label + ':':<10}{first}" + "".join(f"\n{pad}{line}" for line in rest)


def _clip(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` within about ``limit`` characters: whole lines from its start and its end (a case's setup, and
    the steps just before the one that differs), with "..." between; a single long line is cut at the end."""
    if len(text) <= limit:
        return text
    lines = text.splitlines()
    head: list[str] = []
    while lines and sum(map(len, head)) + len(lines[0]) <= limit // 2:
        head.append(lines.pop(0))
    tail: list[str] = []
    while lines and sum(map(len, head + tail)) + len(lines[-1]) <= limit:
        tail.insert(0, lines.pop())
    if not head or not tail:
        return text[: limit - 3] + "..."
    return "\n".join([*head, *(["..."] if lines else []), *tail])
