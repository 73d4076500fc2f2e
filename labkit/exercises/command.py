"""``labkit check``: every exercise's status against the learner's files, as a progress table (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from labkit.exercises import check_file, exercises

STYLES = {"passed": "green", "failing": "red", "not started": "dim"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="labkit check",
        description="Check the exercises in exercises/exN_*.py against labkit's contracts and show your progress.",
    )
    parser.add_argument("numbers", nargs="*", type=int, help="exercises to check (default: all)")
    parser.add_argument("--path", help="the folder holding your exercise files (default: ./exercises)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON (for instructors)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the feedback of every failing exercise")
    args = parser.parse_args(argv)
    table = exercises()
    unknown = sorted(set(args.numbers) - set(table))
    if unknown:
        parser.error(f"no exercise {unknown[0]}; there are {sorted(table)}")
    chosen = [table[n] for n in args.numbers] if args.numbers else list(table.values())
    results = [check_file(exercise, args.path) for exercise in chosen]
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return 0 if all(r.passed for r in results) else 1
    console = Console()
    view = Table(title="labkit exercises")
    for column in ("#", "exercise", "status", "checks"):
        view.add_column(column, justify="right" if column in ("#", "checks") else "left")
    for r in results:
        style = STYLES[r.status]
        view.add_row(str(r.number), r.title, f"[{style}]{r.status}[/{style}]", f"{r.num_passed}/{r.num_cases}")
    console.print(view)
    done = sum(r.passed for r in results)
    console.print(f"{done} of {len(results)} exercises pass.")
    for r in results:
        if args.verbose and not r.passed:
            print(r.report(), end="\n\n")
    following = next((r for r in results if not r.passed), None)
    if following is not None and not args.verbose:
        console.print(
            f"Next: exercise {following.number}. Details: labkit check {following.number} -v", highlight=False
        )
    return 0 if done == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
