"""The learner's checks: `pytest -m ex3 exercises/` runs exercise 3's checks against exercises/ex3_*.py.

Every check fails on the untouched stubs, so they run only when the ``-m`` expression names an exercise
(``ex1`` ... ``exN``); a plain ``pytest`` (as CI runs it) collects just this folder's notebooks.
"""

from __future__ import annotations

import re

import pytest

from labkit.exercises import exercises


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "learner: a check of the learner's own exercise file")
    for number, exercise in exercises().items():
        config.addinivalue_line("markers", f"ex{number}: exercise {number}, {exercise.title} (your exercises/ file)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if re.search(r"\bex\d+\b", config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="your exercise checks run with `pytest -m exN exercises/` (or `labkit check`)")
    for item in items:
        if item.get_closest_marker("learner") is not None:
            item.add_marker(skip)
