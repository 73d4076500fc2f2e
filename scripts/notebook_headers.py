"""Write the Colab badge and the install cell of every course and exercise notebook from pyproject.toml.

The repository URL lives in one place, ``[project.urls] Repository`` in pyproject.toml, and the branch or tag
that learners get in another, ``[tool.labkit] course-ref`` ("main" unless a class pins a release, so that a push
during the course changes nothing they run). Every notebook in notebooks/ and exercises/ gets, from them:

* the Colab badge: the line of the first (markdown) cell that starts with ``[![Open In Colab]``, placed
  right after the title when it is missing;
* the install cell: the code cell tagged ``install``, second in the notebook, which installs labkit only
  where it is missing (Colab) and turns on Colab's widget manager;

and the README's Colab and Binder badges open the start notebook at that ref.

    python scripts/notebook_headers.py           # rewrite the notebooks that disagree
    python scripts/notebook_headers.py --check   # exit 1, listing the notebooks that disagree

Publishing under another URL is then a one-line change in pyproject.toml and one run of this script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIRS = ("notebooks", "exercises")
BADGE_PREFIX = "[![Open In Colab]"
BINDER_PREFIX = "[![Binder]"
DEFAULT_REF = "main"
START_NOTEBOOK = "notebooks/00_start_here.ipynb"
INSTALL_TAG = "install"
INSTALL_SOURCE = """\
# Installs labkit when it is missing (Colab); a no-op locally and on Binder.
import importlib.util
import sys

if importlib.util.find_spec("labkit") is None:
    %pip install -q "labkit-batching[widgets,nvml] @ git+{repository}{at_ref}"
if "google.colab" in sys.modules:
    from google.colab import output

    output.enable_custom_widget_manager()"""


def _pyproject(root: Path) -> dict:
    with open(root / "pyproject.toml", "rb") as file:
        return tomllib.load(file)


def repository_url(root: Path = ROOT) -> str:
    """``[project.urls] Repository`` of pyproject.toml, without a trailing slash."""
    try:
        return _pyproject(root)["project"]["urls"]["Repository"].rstrip("/")
    except KeyError:
        raise SystemExit("pyproject.toml has no [project.urls] Repository") from None


def course_ref(root: Path = ROOT) -> str:
    """``[tool.labkit] course-ref`` of pyproject.toml: the branch or tag learners open, "main" by default."""
    return _pyproject(root).get("tool", {}).get("labkit", {}).get("course-ref", DEFAULT_REF)


def notebook_paths(root: Path = ROOT) -> list[Path]:
    """Every notebook the course ships: notebooks/*.ipynb, then exercises/*.ipynb, each folder sorted."""
    return [path for folder in NOTEBOOK_DIRS for path in sorted((root / folder).glob("*.ipynb"))]


def _github_slug(repository: str) -> str:
    if not repository.startswith("https://github.com/"):
        raise ValueError(f"Colab opens notebooks from GitHub; the repository URL is {repository!r}")
    return repository.removeprefix("https://github.com/")


def badge_line(repository: str, relative_path: str, ref: str = DEFAULT_REF) -> str:
    """The "Open In Colab" badge of the notebook at ``relative_path`` (from the repository root), at ``ref``."""
    return (
        "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
        f"(https://colab.research.google.com/github/{_github_slug(repository)}/blob/{ref}/{relative_path})"
    )


def binder_badge_line(repository: str, ref: str = DEFAULT_REF) -> str:
    """The README's Binder badge: the start notebook, on the default branch (HEAD) or at ``ref``."""
    binder_ref = "HEAD" if ref == DEFAULT_REF else ref
    return (
        "[![Binder](https://mybinder.org/badge_logo.svg)]"
        f"(https://mybinder.org/v2/gh/{_github_slug(repository)}/{binder_ref}?urlpath=lab/tree/{START_NOTEBOOK})"
    )


def install_source(repository: str, ref: str = DEFAULT_REF) -> str:
    return INSTALL_SOURCE.format(repository=repository, at_ref="" if ref == DEFAULT_REF else f"@{ref}")


def with_readme_badges(text: str, repository: str, ref: str = DEFAULT_REF) -> str:
    """The README's text with its Colab and Binder badge lines pointing at ``ref``."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(BADGE_PREFIX):
            lines[i] = badge_line(repository, START_NOTEBOOK, ref) + "\n"
        elif line.startswith(BINDER_PREFIX):
            lines[i] = binder_badge_line(repository, ref) + "\n"
    return "".join(lines)


def with_headers(
    nb: nbformat.NotebookNode, repository: str, relative_path: str, ref: str = DEFAULT_REF
) -> nbformat.NotebookNode:
    """``nb`` with its badge line and install cell as they should be (changed in place, and returned)."""
    if not nb.cells or nb.cells[0].cell_type != "markdown":
        raise ValueError(f"{relative_path}: the first cell must be markdown (the title and the badge)")
    badge = badge_line(repository, relative_path, ref)
    lines = nb.cells[0].source.splitlines()
    badges = [i for i, line in enumerate(lines) if line.startswith(BADGE_PREFIX)]
    if badges:
        lines[badges[0]] = badge
    else:
        lines[1:1] = ["", badge]
    nb.cells[0].source = "\n".join(lines)

    install = [i for i, cell in enumerate(nb.cells) if INSTALL_TAG in cell.get("metadata", {}).get("tags", [])]
    if install:
        cell = nb.cells.pop(install[0])
        cell.source = install_source(repository, ref)
    else:
        cell = nbformat.v4.new_code_cell(install_source(repository, ref), metadata={"tags": [INSTALL_TAG]})
    nb.cells.insert(1, cell)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook disagrees")
    args = parser.parse_args(argv)
    repository, ref = repository_url(), course_ref()
    stale = []
    readme = ROOT / "README.md"
    text = readme.read_text()
    if (updated := with_readme_badges(text, repository, ref)) != text:
        stale.append("README.md")
        if not args.check:
            readme.write_text(updated)
    for path in notebook_paths():
        relative = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        nb = nbformat.reads(text, as_version=4)
        try:
            with_headers(nb, repository, relative, ref)
        except ValueError as error:
            print(error, file=sys.stderr)
            stale.append(relative)
            continue
        updated = nbformat.writes(nb) + "\n"
        if nbformat.reads(updated, as_version=4) != nbformat.reads(text, as_version=4):
            stale.append(relative)
            if not args.check:
                path.write_text(updated)
    if args.check and stale:
        print("files whose badges or install cell disagree with pyproject.toml:", file=sys.stderr)
        for relative in stale:
            print(f"  {relative}", file=sys.stderr)
        print("fix: python scripts/notebook_headers.py", file=sys.stderr)
        return 1
    for relative in stale if not args.check else ():
        print(f"updated {relative}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
