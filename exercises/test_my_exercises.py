"""Your exercises, checked case by case: `pytest -m ex1 exercises/` (each check fails until you solve it)."""

from __future__ import annotations

import pytest

from labkit.exercises import exercises, load_implementation
from labkit.exercises.framework import run_case

CASES = [
    pytest.param(
        number,
        case.name,
        marks=[getattr(pytest.mark, f"ex{number}"), pytest.mark.learner],
        id=f"ex{number}: {case.name}",
    )
    for number, exercise in exercises().items()
    for case in exercise.cases
]


@pytest.mark.parametrize(("number", "name"), CASES)
def test_exercise(number: int, name: str) -> None:
    exercise = exercises()[number]
    implementation, _, error = load_implementation(exercise)
    if error:
        pytest.fail(error, pytrace=False)
    case = next(c for c in exercise.cases if c.name == name)
    failure = run_case(case, implementation)
    if failure is not None and failure.kind == "stopped":  # a Ctrl-C: say where the code was, then stop the run
        print(failure.message())
        raise KeyboardInterrupt
    if failure is not None:
        where = f"; fill in exercises/{exercise.filename}" if failure.kind == "not started" else ""
        pytest.fail(failure.message() + where, pytrace=False)
