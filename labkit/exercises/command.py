"""``labkit check``: every exercise's status against the learner's files, as a progress table (or JSON).

``labkit check --watch`` stays on and checks an exercise again each time its file is saved, as rustlings' watch
mode does: edit, save, read the feedback, with no command to retype.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from labkit.exercises import CheckResult, Exercise, check_file, exercises
from labkit.exercises.framework import find_learner_file

STYLES = {"passed": "green", "failing": "red", "not started": "dim", "no file": "yellow"}
WATCH_INTERVAL = 0.5  # seconds between looks at the learner's files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="labkit check",
        description="Check the exercises in exercises/exN_*.py against labkit's contracts and show your progress.",
    )
    parser.add_argument("numbers", nargs="*", type=int, help="exercises to check (default: all)")
    parser.add_argument(
        "--path", help="the folder holding your exercise files, or a copy of the repository (default: ./exercises)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON (for instructors)")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print the feedback of every failing exercise (always, when one exercise is named)",
    )
    parser.add_argument(
        "-w", "--watch", action="store_true", help="stay on: check an exercise again each time its file is saved"
    )
    args = parser.parse_args(argv)
    table = exercises()
    unknown = sorted(set(args.numbers) - set(table))
    if unknown:
        parser.error(f"no exercise {unknown[0]}; there are {sorted(table)}")
    if args.watch and args.json:
        parser.error("--watch prints for a person; --json is for a script, which runs once")
    if args.path is not None and not Path(args.path).is_dir():
        parser.error(f"--path {args.path}: no such folder (it holds your exN_*.py files)")
    chosen = sorted((table[n] for n in args.numbers or table), key=lambda e: e.course_position)
    # With --json, what the learner's code prints goes to stderr: stdout stays one JSON document for the script.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        results = [check_file(exercise, args.path) for exercise in chosen]
    if args.json:
        entries = [{**r.to_dict(), "after_notebooks": list(e.after)} for e, r in zip(chosen, results, strict=True)]
        print(json.dumps(entries, indent=2))
        return 0 if all(r.passed for r in results) else 1
    console = Console()
    # One exercise named: the learner is working on it, so its feedback is what they came for.
    show_progress(chosen, results, console, verbose=args.verbose or len(args.numbers) == 1, path=args.path)
    if args.watch:
        results = watch(chosen, results, args.path, console)
    return 0 if all(r.passed for r in results) else 1


def show_progress(
    chosen: list[Exercise], results: list[CheckResult], console: Console, *, verbose: bool, path: str | None = None
) -> None:
    """The progress table in course order (``path``: the folder checked, named in its title), then every failing
    exercise's feedback (verbose) or which one to do next: the first in the course that does not pass yet."""
    view = Table(title="labkit exercises, in course order" + (f", in {path}" if path is not None else ""))
    for column in ("#", "exercise", "after", "status", "checks"):
        view.add_column(column, justify="right" if column in ("#", "checks") else "left")
    for exercise, r in zip(chosen, results, strict=True):
        style = STYLES[r.status]
        view.add_row(
            str(r.number),
            r.title,
            ", ".join(exercise.after),
            f"[{style}]{r.status}[/{style}]",
            f"{r.num_passed}/{r.num_cases}",
        )
    console.print(view)
    done = sum(r.passed for r in results)
    console.print(f"{done} of {len(results)} exercises pass.")
    for r in results:
        if verbose and not r.passed:
            print(r.report(), end="\n\n")
    following = next((e for e, r in zip(chosen, results, strict=True) if not r.passed), None)
    if following is not None and not verbose:
        console.print(
            f"Next: exercise {following.number}, after notebook {' and '.join(following.after)}."
            f" Its feedback: labkit check {following.number}",
            highlight=False,
        )


def watch(
    chosen: list[Exercise],
    results: list[CheckResult],
    path: str | None,
    console: Console,
    sleep: Callable[[float], None] = time.sleep,
) -> list[CheckResult]:
    """Until Ctrl+C: each time a learner's file changes, check that exercise again and print its feedback.

    A file counts as changed when its modification time or size does; one that appears (a new exercise file)
    counts too. Returns the latest result of every exercise.
    """
    results = list(results)
    seen = {exercise.number: _signature(exercise, path) for exercise in chosen}
    console.print(f"Watching {len(chosen)} exercise file(s) for changes; Ctrl+C stops.", highlight=False)
    sys.stdout.flush()
    try:
        while True:
            sleep(WATCH_INTERVAL)
            for index, exercise in enumerate(chosen):
                signature = _signature(exercise, path)
                if signature == seen[exercise.number]:
                    continue
                seen[exercise.number] = signature
                results[index] = result = check_file(exercise, path)
                console.rule(f"exercise {exercise.number} saved: {result.status}", style=STYLES[result.status])
                print(result.report(), end="\n\n")
                done = sum(r.passed for r in results)
                console.print(f"{done} of {len(results)} exercises pass.")
                sys.stdout.flush()  # shown at once, also where the output goes to a pipe or a file
    except KeyboardInterrupt:
        console.print("Stopped watching.")
    return results


def _signature(exercise: Exercise, path: str | None) -> tuple[int, int] | None:
    """When the learner's file last changed, and its size; None while it does not exist."""
    file = find_learner_file(exercise, path)
    if file is None:
        return None
    try:
        stat = file.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


if __name__ == "__main__":
    sys.exit(main())
