"""Exercises: learners build the engine's parts, check them here, then run them inside the real engine.

Each exercise is a learner's file ``exercises/exN_<topic>.py`` (typed stubs that raise
``NotImplementedError("Exercise N")``), a check module ``labkit/exercises/exN_<topic>.py`` defining
``EXERCISE`` (found here by name: adding an exercise needs no registration) and a notebook
``exercises/exN_<topic>.ipynb``. The reference solutions are labkit's own classes and functions.

>>> from labkit.exercises import check, start_exercise
>>> result = check(1)                       # imports exercises/ex1_block_allocator.py
>>> result = check(1, MyBlockAllocator)     # or an implementation defined in a notebook cell
>>> path = start_exercise(1)                # on Colab: writes the stubs to exercises/ex1_block_allocator.py
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any

from labkit.exercises import framework
from labkit.exercises.framework import (
    LABKIT_DIR,
    Case,
    CheckResult,
    Exercise,
    Failure,
    Mismatch,
    find_learner_file,
    labkit_parts,
    labkit_parts_error,
    learner_frames,
    load_learner,
    property_case,
    run_exercise,
)


def exercises() -> dict[int, Exercise]:
    """Every exercise, by number: each ``labkit.exercises.exN_*`` module's ``EXERCISE``."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("ex") and info.name[2:].split("_")[0].isdigit():
            exercise = importlib.import_module(f"{__name__}.{info.name}").EXERCISE
            found[exercise.number] = exercise
    return dict(sorted(found.items()))


def get(number: int) -> Exercise:
    table = exercises()
    if number not in table:
        raise ValueError(f"no exercise {number}; there are {sorted(table)}")
    return table[number]


def reference(number: int) -> Any:
    """labkit's own implementation, which every check of exercise ``number`` passes."""
    return get(number).reference()


def start_exercise(number: int, folder: str | os.PathLike[str] = "exercises") -> Path:
    """Your file for exercise ``number``: the one :func:`check` imports, or, where there is none, a fresh copy of
    its stubs written to ``folder``. On Colab labkit is installed without the repository's files: this puts the
    file where ``check`` finds it, to open from the file browser. An existing file is never overwritten."""
    exercise = get(number)
    found = find_learner_file(exercise)
    if found is not None:
        print(f"Your file for exercise {number} is {display_path(found)}: fill in its stubs, then check again.")
        _on_colab(number, found)
        return found
    stubs = (files(__name__) / "stubs" / exercise.filename).read_text()
    if f'NotImplementedError("Exercise {number}")' not in stubs:
        raise RuntimeError(
            f"labkit's copy of the stubs of exercise {number} holds a solution, not stubs: this installation was"
            " built from a checkout whose exercises/ were filled in. Build it again from a clean checkout."
        )
    target = Path(folder) / exercise.filename
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(stubs)
    print(
        f"Wrote the stubs of exercise {number} to {display_path(target)}: open it (on Colab, from the file browser"
        " on the left), fill them in, save, then check again."
    )
    _on_colab(number, target)
    return target


def _on_colab(number: int, file: Path) -> None:
    """On Colab, how to check ``file`` and keep it: labkit came without the repository, whose tests ``pytest -m exN``
    runs, and the runtime's disk, ``file`` with it, is wiped when Colab recycles the runtime."""
    if "google.colab" not in sys.modules:
        return
    print(
        f"On Colab, check it with check({number}) in a cell, as the exercise's notebook does, or !labkit check"
        f" {number}: pytest -m ex{number} exercises/ needs the repository's tests, which Colab has not got."
        f" {file.resolve()} lives on this runtime only and vanishes when Colab recycles it (idle, or at the end of"
        " the session): save it before you leave, by downloading it from the file browser (right-click, Download)"
        " or copying it to your Google Drive."
    )


def check(
    number: int,
    implementation: Any = None,
    *,
    path: str | os.PathLike[str] | None = None,
    verbose: bool = False,
    quiet: bool = False,
) -> CheckResult:
    """Check exercise ``number`` and print friendly feedback; return a CheckResult (``.passed``, ``.failures``).

    With no ``implementation`` the learner's file is imported: ``path`` (the file or its folder), else
    $LABKIT_EXERCISES_DIR, ./exercises, the current folder or the repository's exercises/. Failing
    cases show their input, what was expected, what came back and a hint; ``verbose=True`` adds full
    tracebacks, ``quiet=True`` prints nothing.
    """
    exercise = get(number)
    if implementation is not None:
        result = run_exercise(exercise, implementation, "your implementation", verbose=verbose)
    else:
        result = check_file(exercise, path, verbose=verbose)
    if not quiet:
        print(result.report())
    return result


def load_implementation(exercise: Exercise, path: str | os.PathLike[str] | None = None) -> tuple[Any, str, str]:
    """(implementation, where it came from, error): the learner's file imported afresh; error "" when it loaded
    and defines the exercise's code itself."""
    file = find_learner_file(exercise, path)
    if file is None or not file.is_file():
        where = str(file) if file is not None else f"exercises/{exercise.filename}"
        error = (
            f"no file {where} here: open the repository's exercises folder, write the stubs here with"
            f" start_exercise({exercise.number}), or define your implementation in a cell and pass it:"
            f" check({exercise.number}, {exercise.export})"
        )
        return None, where, error
    try:
        with framework.time_limit(framework.CASE_SECONDS):  # a loop at the file's top level would hang the check
            implementation = load_learner(exercise, file)
    except framework.OutOfTime as stopped:
        where = learner_frames(stopped)
        seconds = framework.CASE_SECONDS
        error = f"your file was still loading after {seconds:.0f} s, and was stopped: a loop at its top level?"
        return None, display_path(file), error + (f"\n{where}" if where else "")
    except (Exception, SystemExit) as error:  # a syntax error, a missing name, a sys.exit() in the learner's file
        where = learner_frames(error)
        return (
            None,
            display_path(file),
            f"your file does not load: {type(error).__name__}: {error}" + (f"\n{where}" if where else ""),
        )
    if parts := labkit_parts(exercise, implementation):  # labkit's own code would pass for the learner's
        return None, display_path(file), labkit_parts_error(exercise, parts)
    return implementation, display_path(file), ""


def display_path(file: Path) -> str:
    """``file`` relative to the current folder or the repository when it lies inside one of them."""
    for root in (Path.cwd(), LABKIT_DIR.parent):
        try:
            return str(file.resolve().relative_to(root.resolve()))
        except ValueError:
            continue
    return str(file)


def check_file(exercise: Exercise, path: str | os.PathLike[str] | None = None, *, verbose: bool = False) -> CheckResult:
    """Check the learner's file for ``exercise`` (found as :func:`check` finds it), printing nothing."""
    implementation, source, error = load_implementation(exercise, path)
    if error:
        return CheckResult(exercise.number, exercise.title, source, len(exercise.cases), load_error=error)
    return run_exercise(exercise, implementation, source, verbose=verbose)


def progress(path: str | os.PathLike[str] | None = None) -> list[CheckResult]:
    """Every exercise checked quietly against the learner's files: what ``labkit check`` shows."""
    return [check_file(exercise, path) for exercise in exercises().values()]


__all__ = [
    "Case",
    "CheckResult",
    "Exercise",
    "Failure",
    "Mismatch",
    "check",
    "check_file",
    "exercises",
    "get",
    "load_implementation",
    "progress",
    "property_case",
    "reference",
    "start_exercise",
]
