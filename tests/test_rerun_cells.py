"""Every notebook run the way learners run one: top to bottom, then again with each code cell twice in a row, then
every checked cell once more.

nbval runs a notebook once, top to bottom. Learners run a cell again, after an edit or a Ctrl-C, and the course must
say the same then: a cell that ran its engine a second time on the engine of the first run counted the first run's
steps, and a later cell that rebound a name an earlier checked cell reads broke that cell's check. Every output of a
cell marked NBVAL_CHECK_OUTPUT (deterministic by design) must be the same text each time it runs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "exercises").glob("*.ipynb"))
CHECKED = "# NBVAL_CHECK_OUTPUT"


def output_text(outputs: list) -> str:
    """What a cell printed, returned or raised, as one text: a stream split into several outputs reads the same."""
    parts = []
    for output in outputs:
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type == "execute_result":
            parts.append(output.data.get("text/plain", "") + "\n")
        elif output.output_type == "error":
            parts.append(f"{output.ename}: {output.evalue}\n")
    return "".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_each_cell_run_again_says_the_same(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbclient import NotebookClient

    for name, value in {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)  # the kernel inherits them, as scripts/run_notebooks.py runs it
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    said: dict[int, list[str]] = {}

    def run(index: int) -> None:
        cell = copy.deepcopy(nb.cells[index])  # the notebook's own outputs stay as committed
        client.execute_cell(cell, index)  # an error in the cell raises CellExecutionError, naming it
        if cell.source.startswith(CHECKED):
            said.setdefault(index, []).append(output_text(cell.outputs))

    code = [index for index, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    with client.setup_kernel():
        for index in code:
            run(index)
        for index in code:  # a cell run again on what it built the first time (an engine, a recorder) shows here
            run(index)
            run(index)
        for index in list(said):  # after the whole notebook: a later cell must not have changed what it reads
            run(index)
    assert said, f"{path.name} has no checked cell"
    for index, texts in said.items():
        first_line = nb.cells[index].source.splitlines()[1] if "\n" in nb.cells[index].source else ""
        assert texts[1:] == texts[:1] * (len(texts) - 1), (
            f"{path.name}, cell {index} ({first_line!r}) said something else when run again:\n" + "\n---\n".join(texts)
        )
