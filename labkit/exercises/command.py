"""``labkit check``: every exercise's status against the learner's files, as a progress table (or JSON).

``labkit check --watch`` stays on and checks an exercise again each time its file is saved, as rustlings' watch
mode does: edit, save, read the feedback, with no command to retype. ``labkit check --class FOLDER`` checks a
class's work, one learner per subfolder, into one table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from labkit.exercises import CheckResult, Exercise, check_file, exercises
from labkit.exercises.framework import find_learner_file

STYLES = {"passed": "green", "failing": "red", "not started": "dim", "no file": "yellow"}
WATCH_INTERVAL = 0.5  # seconds between looks at the learner's files
LEARNER_SECONDS = 30 * 60  # the most one learner's checks may take in a class check (each case has 60 s)
MARKS = {"passed": "✓", "not started": "·", "no file": "-"}  # a failing exercise shows its checks passed


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
    parser.add_argument(
        "--class",
        dest="class_folder",
        metavar="FOLDER",
        help="a class's work, one subfolder per learner (their files or checkout): one table, a row per learner",
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
    if args.class_folder is not None:
        if args.path is not None or args.watch:
            parser.error("--class checks each subfolder of its folder: it takes no --path, and runs once (no --watch)")
        learners = _learner_folders(Path(args.class_folder))
        if not learners:
            parser.error(
                f"--class {args.class_folder}: no subfolders (put each learner's files in a folder of its own)"
            )
        return _check_a_class(learners, chosen, as_json=args.json)
    # With --json, what the learner's code prints goes to stderr: stdout stays one JSON document for the script.
    results = []
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        for exercise in chosen:
            results.append(check_file(exercise, args.path))
            if _stopped(results[-1]) and not args.watch:  # a Ctrl-C: the exercises checked so far, then no more
                break
    stopped, not_checked = any(_stopped(r) for r in results) and not args.watch, chosen[len(results) :]
    chosen = chosen[: len(results)]
    if args.json:
        entries = [{**r.to_dict(), "after_notebooks": list(e.after)} for e, r in zip(chosen, results, strict=True)]
        print(json.dumps(entries, indent=2))
        return 130 if stopped else 0 if all(r.passed for r in results) else 1
    console = Console()
    # One exercise named: the learner is working on it, so its feedback is what they came for; likewise after a Ctrl-C.
    verbose = args.verbose or len(args.numbers) == 1 or stopped
    show_progress(chosen, results, console, verbose=verbose, path=args.path)
    if stopped:
        console.print("Stopped" + (": the exercises after it were not checked." if not_checked else "."))
        return 130
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


def _check_a_class(learners: list[Path], chosen: list[Exercise], *, as_json: bool) -> int:
    """``labkit check --class``: the table (or JSON) of every learner; 0 when every learner passes every exercise."""
    found = check_class(learners, [e.number for e in chosen])
    if as_json:
        print(json.dumps(found, indent=2))
    else:
        show_class(chosen, found, Console())
    everyone_passed = all(isinstance(r, list) and all(e["status"] == "passed" for e in r) for r in found.values())
    return 0 if everyone_passed else 1


def _stopped(result: CheckResult) -> bool:
    """Whether the learner stopped this check with a Ctrl-C."""
    return any(failure.kind == "stopped" for failure in result.failures)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send what is written to stdout to stderr meanwhile, at the file descriptor too, so that a learner's thread or
    subprocess (os.system) that prints cannot break the JSON printed afterwards."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _learner_folders(folder: Path) -> list[Path]:
    """The subfolders of a class's folder, by name; hidden ones (.git, .ipynb_checkpoints) are not learners."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def check_class(learners: Sequence[Path], numbers: Sequence[int]) -> dict[str, list[dict[str, Any]] | str]:
    """Each learner's folder checked by ``labkit check --json`` in a process of its own, by folder name: the
    learner's JSON entries, or why their check did not finish.

    The checks run the learner's code in the checking process, so one learner's code must not reach another's
    checks: a patched labkit class, a module left in ``sys.modules``, a crash or an endless loop outside the
    checks' own time limit (stopped after LEARNER_SECONDS).
    """
    found: dict[str, list[dict[str, Any]] | str] = {}
    for index, folder in enumerate(learners, start=1):
        print(f"checking {folder.name} ({index} of {len(learners)})", file=sys.stderr, flush=True)
        command = [sys.executable, "-m", "labkit.exercises.command", "--json", "--path", str(folder)]
        try:
            done = subprocess.run(
                [*command, *map(str, numbers)], capture_output=True, text=True, timeout=LEARNER_SECONDS
            )
        except subprocess.TimeoutExpired:
            found[folder.name] = f"stopped after {LEARNER_SECONDS} s"
            continue
        try:
            found[folder.name] = json.loads(done.stdout)
        except json.JSONDecodeError:
            last = (done.stderr.strip().splitlines() or [""])[-1]
            found[folder.name] = f"the check did not finish (exit status {done.returncode})" + (
                f": {last}" if last else ""
            )
    return found


def show_class(chosen: list[Exercise], found: dict[str, list[dict[str, Any]] | str], console: Console) -> None:
    """A row per learner, a column per exercise in course order: ✓ passed, the checks passed where failing,
    · not started, - no file."""
    view = Table(title="labkit exercises of a class, in course order")
    view.add_column("learner")
    for exercise in chosen:
        view.add_column(str(exercise.number), justify="center")
    view.add_column("passed", justify="right")
    for learner, entries in found.items():
        if isinstance(entries, str):  # the learner's names and texts are not rich markup
            view.add_row(escape(learner), *[""] * len(chosen), f"[red]{escape(entries)}[/red]")
            continue
        marks = []
        for entry in entries:
            style, mark = STYLES[entry["status"]], MARKS.get(entry["status"], f"{entry['passed']}/{entry['cases']}")
            marks.append(f"[{style}]{mark}[/{style}]")
        view.add_row(escape(learner), *marks, f"{sum(e['status'] == 'passed' for e in entries)}/{len(entries)}")
    console.print(view)
    console.print("✓: passed, n/m: checks passed so far, ·: not started (the stub), -: no file", highlight=False)


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
