"""The course as a product: every notebook's shape, the headers written from pyproject, the Binder environment,
the HTML rendering, the lab command, and (marked ``notebooks``) every notebook run again with other parameters.

Notebooks are found by globbing notebooks/ and exercises/, so a new notebook is checked the day it lands.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import notebook_headers  # noqa: E402

COURSE = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
ALL = COURSE + EXERCISES
REQUIRED_PARAMETERS = ("model_name", "device", "num_requests", "block_size", "seed")
MAX_NOTEBOOK_BYTES = 300 * 1024


def _ids(paths: list[Path]) -> list[str]:
    return [p.relative_to(ROOT).as_posix() for p in paths]


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _tagged(nb: nbformat.NotebookNode, tag: str) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]


def _parameters(nb: nbformat.NotebookNode) -> dict[str, object]:
    """The names the ``parameters`` cell assigns, with their literal values."""
    [cell] = _tagged(nb, "parameters")
    values = {}
    for node in ast.parse(cell.source).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = ast.literal_eval(node.value)
    return values


def _markdown(nb: nbformat.NotebookNode) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def test_there_are_course_notebooks() -> None:
    names = [p.stem for p in COURSE]
    assert "00_start_here" in names
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+", name) for name in names), names


# ---------------------------------------------------------------------------------------------- headers
def test_headers_agree_with_pyproject() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "notebook_headers.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_headers_follow_the_repository_url() -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 99 · Title\n\nText.")])
    notebook_headers.with_headers(nb, "https://github.com/someone/fork", "notebooks/99_x.ipynb")
    badge = nb.cells[0].source.splitlines()[2]
    assert badge.endswith("(https://colab.research.google.com/github/someone/fork/blob/main/notebooks/99_x.ipynb)")
    assert nb.cells[1].metadata.tags == ["install"]
    assert "git+https://github.com/someone/fork" in nb.cells[1].source
    # Idempotent: a second pass changes nothing; another URL changes both lines.
    again = nbformat.from_dict(json.loads(json.dumps(nb)))
    assert notebook_headers.with_headers(again, "https://github.com/someone/fork", "notebooks/99_x.ipynb") == nb
    notebook_headers.with_headers(again, "https://github.com/other/repo", "notebooks/99_x.ipynb")
    assert "other/repo" in again.cells[0].source and "other/repo" in again.cells[1].source
    assert len(again.cells) == 2


def test_a_pinned_course_ref_reaches_every_link_learners_open(tmp_path: Path) -> None:
    """A class pins a release: the notebooks' Colab badge and install cell, and the README's Colab and Binder badges,
    all open that tag; "main" keeps the default branch (HEAD on Binder, no @ in the install)."""
    repository = "https://github.com/someone/fork"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 99 · Title")])
    notebook_headers.with_headers(nb, repository, "notebooks/99_x.ipynb", "v1.2")
    assert "/someone/fork/blob/v1.2/notebooks/99_x.ipynb)" in nb.cells[0].source
    assert '@ git+https://github.com/someone/fork@v1.2"' in nb.cells[1].source
    readme = (ROOT / "README.md").read_text()
    pinned = notebook_headers.with_readme_badges(readme, repository, "v1.2").splitlines()
    changed = [new for old, new in zip(readme.splitlines(), pinned, strict=True) if old != new]
    assert len(changed) == 2 and all("/someone/fork/" in line and "v1.2" in line for line in changed), changed
    assert any(
        "mybinder.org/v2/gh/someone/fork/v1.2?urlpath=lab/tree/notebooks/00_start_here.ipynb" in line
        for line in changed
    )
    repository, ref = notebook_headers.repository_url(), notebook_headers.course_ref()
    assert notebook_headers.with_readme_badges(readme, repository, ref) == readme  # as committed
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.labkit]\ncourse-ref = "v1.2"\n')
    assert notebook_headers.course_ref(tmp_path) == "v1.2"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert notebook_headers.course_ref(tmp_path) == "main"


def test_the_install_cell_names_extras_the_project_has() -> None:
    """pip only warns about an extra it does not know, and installs without it: a misspelt one would go unseen."""
    source = notebook_headers.install_source(notebook_headers.repository_url())
    extras = re.search(r'"labkit-batching\[([^\]]*)\] @', source).group(1).split(",")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(extras) <= set(project["optional-dependencies"]), extras
    assert {"widgets", "nvml"} <= set(extras)  # the widgets, and NVML's utilisation on a Colab GPU


def test_headers_read_the_project(tmp_path: Path) -> None:
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\n[project.urls]\nRepository = "https://github.com/a/b"\n'
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 00 · T")])
    nbformat.write(nb, tmp_path / "notebooks" / "00_t.ipynb")
    assert notebook_headers.repository_url(tmp_path) == "https://github.com/a/b"
    assert notebook_headers.notebook_paths(tmp_path) == [tmp_path / "notebooks" / "00_t.ipynb"]
    with pytest.raises(ValueError, match="GitHub"):
        notebook_headers.badge_line("https://gitlab.com/a/b", "notebooks/00_t.ipynb")


# ---------------------------------------------------------------------------------------------- every notebook
@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_notebook_header_cells(path: Path) -> None:
    nb = _read(path)
    relative = path.relative_to(ROOT).as_posix()
    repository, ref = notebook_headers.repository_url(), notebook_headers.course_ref()
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "the first cell is the title"
    assert notebook_headers.badge_line(repository, relative, ref) in first.source.splitlines()
    assert nb.cells[1].metadata.get("tags") == ["install"]
    assert nb.cells[1].source == notebook_headers.install_source(repository, ref)
    assert 'if importlib.util.find_spec("labkit") is None:' in nb.cells[1].source  # guarded: a no-op locally
    parameters = _tagged(nb, "parameters")
    assert len(parameters) == 1 and nb.cells.index(parameters[0]) == 2, "the third cell is the parameters cell"
    values = _parameters(nb)
    missing = [name for name in REQUIRED_PARAMETERS if name not in values]
    assert not missing, f"the parameters cell lacks {missing}"
    assert values["model_name"] == "auto" and values["device"] == "auto"
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES
    assert "widgets" not in nb.metadata, "committed notebooks carry no widget state"


@pytest.mark.parametrize("path", COURSE, ids=_ids(COURSE))
def test_course_notebook_lesson_shape(path: Path) -> None:
    nb = _read(path)
    text = _markdown(nb)
    assert re.match(rf"# {path.stem[:2]} · \S", nb.cells[0].source), "title: '# NN · Title'"
    assert "## Learning goals" in text
    goals = text.split("## Learning goals", 1)[1].lstrip().splitlines()
    assert goals and goals[0].startswith("- "), "learning goals are a bullet list"
    assert "**Predict, then run:**" in text
    assert "## Summary" in text
    questions = text.split("## Questions", 1)
    assert len(questions) == 2, "a '## Questions' section"
    numbered = re.findall(r"^\d+\. ", questions[1], re.M)
    answers = questions[1].count("<details><summary>Answer</summary>")
    assert numbered and answers == len(numbered) == questions[1].count("</details>"), "each question, its answer"
    pointers = re.findall(r"exercises/(ex\d+_[a-z0-9_]+)\.ipynb", text)
    assert pointers, "a pointer to the matching exercise notebook (exercises/exN_topic.ipynb)"
    if EXERCISES:  # the exercises named exist
        missing = sorted(set(pointers) - {e.stem for e in EXERCISES})
        assert not missing, f"no such exercise: {missing}"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "committed executed: every code cell has run"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, "committed outputs contain an error"


# ---------------------------------------------------------------------------------------------- binder
PYPI_TO_CONDA = {"torch": "pytorch-cpu"}


def _lower_bound(spec: str) -> tuple[str, tuple[int, ...] | None]:
    upper = r"(?:,\s*<\s*[0-9][0-9.]*)?"  # an upper bound, not compared
    match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(?:(>=|==|=)\s*([0-9][0-9.]*))?\s*" + upper + r"\s*", spec)
    assert match, f"cannot read requirement {spec!r}"
    name, _, version = match.groups()
    return name.lower(), tuple(int(x) for x in version.split(".")) if version else None


def test_binder_environment_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in ("widgets", "notebooks"):
        wanted += [d for d in project["optional-dependencies"][extra] if not d.startswith(project["name"])]
    lines = (ROOT / "binder" / "environment.yml").read_text().splitlines()
    start = lines.index("dependencies:")
    have = dict(_lower_bound(line.strip()[2:]) for line in lines[start + 1 :] if line.strip().startswith("- "))
    for requirement in wanted:
        name, bound = _lower_bound(requirement)
        conda = PYPI_TO_CONDA.get(name, name)
        assert conda in have, f"binder/environment.yml lacks {conda} ({requirement} in pyproject.toml)"
        assert have[conda] is not None and have[conda] >= bound, (
            f"binder/environment.yml's {conda} lower bound {have[conda]} is below pyproject's {requirement}"
        )
    python = have["python"]
    assert python is not None and python >= (3, 10)
    post_build = (ROOT / "binder" / "postBuild").read_text()
    assert "--no-deps" in post_build and "-e ." in post_build


def test_jupyterlab_overrides_name_settings_that_exist() -> None:
    """binder/overrides.json (closing a notebook shuts its kernel down) goes where JupyterLab reads it, on Binder and
    in scripts/lab.sh; JupyterLab ignores a setting it does not know, so each one is checked against its schema."""
    pytest.importorskip("jupyterlab")
    schemas = Path(sys.prefix) / "share" / "jupyter" / "lab" / "schemas"
    overrides = json.loads((ROOT / "binder" / "overrides.json").read_text())
    assert overrides["@jupyterlab/notebook-extension:tracker"]["kernelShutdown"] is True
    types = {bool: "boolean", int: "number", str: "string"}
    for plugin, settings in overrides.items():
        package, name = plugin.rsplit(":", 1)
        properties = json.loads((schemas / package / f"{name}.json").read_text())["properties"]
        for key, value in settings.items():
            assert key in properties, f"{plugin} has no setting {key!r}"
            assert properties[key]["type"] == types[type(value)], (plugin, key)
    target = "share/jupyter/lab/settings/overrides.json"
    for script in ("binder/postBuild", "scripts/lab.sh"):
        text = (ROOT / script).read_text()
        assert "cp binder/overrides.json" in text and target.rsplit("/", 1)[0] in text, script


def test_each_exercise_knows_the_notebooks_before_it_as_its_notebook_and_the_readme_name_them() -> None:
    """``labkit check`` lists the exercises in course order from ``Exercise.after``: it must name the notebooks
    that the exercise notebook's "Before this" line links, and that the README's table lists first."""
    from labkit.exercises import exercises

    readme = (ROOT / "README.md").read_text()
    for number, exercise in exercises().items():
        notebook = _read(ROOT / "exercises" / exercise.filename.replace(".py", ".ipynb"))
        [line] = [line for c in notebook.cells for line in c.source.splitlines() if line.startswith("Before this:")]
        assert tuple(re.findall(r"\.\./notebooks/(\d\d)_", line)) == exercise.after, (number, line)
        [row] = [r for r in readme.splitlines() if r.startswith(f"| {number} | [")]
        assert row.split(" | ")[2].startswith(", ".join(exercise.after)), (number, row)
    order = [e.number for e in sorted(exercises().values(), key=lambda e: e.course_position)]
    assert order == [6, 7, 1, 2, 5, 3, 4, 8, 9]
    listed = [int(row[2]) for row in readme.splitlines() if re.match(r"\| \d \| \[", row)]
    assert listed == order, "the README's exercise table is in course order"


def test_binder_badge_opens_the_start_notebook() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "mybinder.org/v2/gh/labkit-course/labkit/HEAD?urlpath=lab/tree/notebooks/00_start_here.ipynb" in readme
    assert (ROOT / "notebooks" / "00_start_here.ipynb").exists()


# ---------------------------------------------------------------------------------------------- lab command
def test_lab_command_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DISPLAY"}
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "lab.sh"), "--print-command", "--port=8899"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    command = result.stdout.split()
    start = "notebooks/00_start_here.ipynb"
    assert command[:3] == [".venv/bin/jupyter", "lab", f"--LabApp.default_url=/lab/tree/{start}"], command
    assert "--ip=127.0.0.1" in command and "--no-browser" in command
    assert "--ServerApp.root_dir=." in command, "the exercises must be in the server's reach, not only notebooks/"
    assert command[-1] == "--port=8899", "extra arguments go to jupyter lab"
    assert (ROOT / start).exists()


# ---------------------------------------------------------------------------------------------- HTML rendering
def _figure_outputs(nb: nbformat.NotebookNode) -> int:
    """Outputs that must render as a plotly figure: plotly JSON and widget views, each saved with its static
    figure as HTML, which exports and kernel-less viewers draw (``labkit.viz.show_figure``)."""
    count = 0
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            for kind in ("application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json"):
                if kind in data:
                    assert "plotly-graph-div" in data.get("text/html", ""), f"{kind} without its static figure"
                    count += 1
    return count


def test_run_notebooks_saves_fresh_outputs_and_no_widget_state(tmp_path: Path) -> None:
    """What scripts/run_notebooks.py saves: this run's outputs, a widget's view but not its state (megabytes of
    plotly.js in a course notebook), and the CI environment the kernel ran in."""
    import run_notebooks

    source = "import os\nimport ipywidgets\nprint(os.environ['OMP_NUM_THREADS'], os.environ['HF_HUB_OFFLINE'])\n"
    cells = [nbformat.v4.new_code_cell(source + "ipywidgets.IntSlider(value=3)")]
    path = tmp_path / "widget.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    assert run_notebooks.run_in_place(path) > 0
    saved = _read(path)
    outputs = saved.cells[0].outputs
    assert outputs[0].text == "1 1\n"
    assert "application/vnd.jupyter.widget-view+json" in outputs[1].data
    assert "widgets" not in saved.metadata
    with pytest.raises(SystemExit):
        run_notebooks.main([str(tmp_path / "missing.ipynb")])


def test_site_renders_every_notebook_with_its_figures(tmp_path: Path) -> None:
    import build_site

    pages = build_site.build(tmp_path)
    assert (tmp_path / "index.html").exists()
    index = (tmp_path / "index.html").read_text()
    assert [p.relative_to(tmp_path).with_suffix(".ipynb") for p in pages] == [p.relative_to(ROOT) for p in ALL]
    for path, page in zip(ALL, pages, strict=True):
        html = page.read_text()
        expected = _figure_outputs(_read(path))
        if path in COURSE:
            assert expected >= 1, f"{path.name} shows no figure"
        assert html.count('class="plotly-graph-div"') >= expected, f"{page.name}: a figure did not render"
        assert "application/vnd.jupyter.widget-view+json" not in html
        assert page.relative_to(tmp_path).as_posix() in index


# ---------------------------------------------------------------------------------------------- papermill
# Every notebook runs twice in CI: under nbval with its defaults (checked outputs, in the main venv), and here,
# through papermill with other values (in the venv of tests/compat/run_colab_pins.sh, under Colab's pinned
# ipywidgets and plotly). These are the other values, in one place: block size 8, seed 1 and fewer requests for
# every notebook, with each notebook's own smaller sizes where its defaults would take long.
OTHER_PARAMETERS = {"block_size": 8, "seed": 1}
OTHER_SIZES: dict[str, dict[str, object]] = {
    "00_start_here": {"num_requests": 6},
    "01_generation_and_kv_cache": {"num_requests": 4},
    "02_static_batching": {"num_requests": 6},
    "03_paged_kv_cache": {"num_requests": 8},
    "04_continuous_batching": {"num_requests": 8},
    "05_chunked_prefill": {"num_requests": 6},
    "06_preemption": {"num_requests": 4},
    "07_serving_under_load": {"num_requests": 6, "sim_requests": 500, "whatif_requests": 150},
    "08_on_a_gpu": {"num_requests": 16},
    "09_prefix_caching_and_policies": {"num_requests": 6},
    # One more than an exercise engine's four seats: a request waits, as the exercises' prose expects.
    **{path.stem: {"num_requests": 5} for path in EXERCISES},
}
WIDGETS = ("BlockMap(", "Timeline(", "LiveThroughput(")


def other_parameters(path: Path) -> dict[str, object]:
    """The papermill run's values for a notebook: its entry of ``OTHER_SIZES`` (or half its requests)."""
    sizes = OTHER_SIZES.get(path.stem) or {"num_requests": max(1, int(_parameters(_read(path))["num_requests"]) // 2)}
    return {**OTHER_PARAMETERS, **sizes}


def test_other_sizes_name_notebooks_and_their_parameters() -> None:
    names = {p.stem: p for p in ALL}
    for stem, sizes in OTHER_SIZES.items():
        assert stem in names, f"OTHER_SIZES names {stem}, which is not a notebook"
        defaults = _parameters(_read(names[stem]))
        for name, value in sizes.items():
            assert name in defaults and value != defaults[name], f"{stem}: {name}={value!r} is not another value"


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _names_bound(tree: ast.AST) -> set[str]:
    """The names a cell binds in the notebook's namespace: at top level and inside its if, for, while, with, try
    and match statements (``if rates == "auto": rates = ...`` overwrites a parameter too), by assignment, a for
    or with target, an import, an except name, a def or class, a match capture or a walrus. A function's or
    class's own names are its own, unless the function declares them ``global``; a comprehension's loop variables
    are the comprehension's."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            declared = {name for n in ast.walk(node) if isinstance(n, ast.Global) for name in n.names}
            names.update(declared & _names_stored(node))
        if isinstance(node, _SCOPES):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
        elif isinstance(node, ast.NamedExpr):
            names.add(node.target.id)
        for child in ast.iter_child_nodes(node):
            if isinstance(node, ast.comprehension) and child is node.target:
                continue  # the comprehension's own variable
            visit(child)

    visit(tree)
    return names


def _names_stored(function: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}


def test_names_bound_finds_nested_assignments() -> None:
    """The check below sees an assignment at any depth of a cell's statements, and none local to a function."""
    cell = """
if rates == "auto":
    rates = [1.0]
for _ in range(2):
    with open(__file__) as handle:
        try:
            targets = "ttft<=1s"
        except OSError as seed:
            pass
while False:
    block_size += 1
if (num_requests := 3) > 2:
    pass
def helper():
    global device
    device = "cpu"
    model_name = "local only"
squares = [threads * threads for threads in range(3)]
"""
    bound = _names_bound(ast.parse(cell))
    assert {"rates", "targets", "handle", "seed", "block_size", "num_requests", "device", "helper"} <= bound
    assert not {"model_name", "threads"} & bound


def _python(source: str) -> str:
    """A cell's source as Python: a shell or magic line (the install cell's %pip) becomes a pass."""
    return "\n".join(re.sub(r"^(\s*)[%!].*", r"\1pass", line) for line in source.splitlines())


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_no_cell_overwrites_a_parameter(path: Path) -> None:
    """A parameter is set in its cell alone: a later cell that assigns the name, at top level or inside an if, a
    loop, a with or a try, would undo what a learner, or the papermill run with other values, chose (a demo's
    block size of 4 once ran the engine too), and a cell that replaces an "auto" parameter with what it measured
    would keep that value when it runs again."""
    nb = _read(path)
    names = set(_parameters(nb))
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "parameters" in cell.metadata.get("tags", []):
            continue
        assigned = _names_bound(ast.parse(_python(cell.source)))
        assert not assigned & names, f"cell {index} assigns the parameter(s) {sorted(assigned & names)}"


@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_no_cell_names_the_kv_cache_argument_of_one_transformers_release(path: Path) -> None:
    """transformers 5.24 renamed the forward pass's past_key_values to cache, and each release ignores the other
    name: a hand-written decode loop then ran without its cache on the releases labkit supports before 5.24
    (notebook 01's check of the loop against generate failed). A cell passes the cache as ``**{CACHE: cache}``."""
    for index, cell in enumerate(_read(path).cells):
        if cell.cell_type == "code":
            for call in (n for n in ast.walk(ast.parse(_python(cell.source))) if isinstance(n, ast.Call)):
                names = {keyword.arg for keyword in call.keywords} & {"cache", "past_key_values"}
                assert not names, f"cell {index} passes the KV cache as {names.pop()}=: use **{{CACHE: cache}}"


@pytest.mark.notebooks
@pytest.mark.parametrize("path", ALL, ids=_ids(ALL))
def test_notebook_runs_with_other_parameters(path: Path, tmp_path: Path) -> None:
    """The notebook runs without errors with other parameters, in a kernel of this test's Python environment
    (its ipywidgets and plotly), and displays a view of every widget it makes."""
    papermill = pytest.importorskip("papermill")
    ipywidgets, plotly = pytest.importorskip("ipywidgets"), pytest.importorskip("plotly")
    nb = _read(path)
    versions = (ipywidgets.__version__, plotly.__version__)
    nb.cells.append(
        nbformat.v4.new_code_cell(
            f"import ipywidgets, plotly\nassert (ipywidgets.__version__, plotly.__version__) == {versions!r}"
        )
    )
    parameters = other_parameters(path)
    executed = papermill.execute_notebook(
        nb,
        str(tmp_path / path.name),
        parameters=parameters,
        cwd=str(path.parent),
        kernel_name="python3",
        progress_bar=False,
        execution_timeout=300,
    )
    injected = _tagged(executed, "injected-parameters")
    assert injected and all(f"{name} = {value!r}" in injected[0].source for name, value in parameters.items())
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    views = sum("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    makes = sum(c.source.count(w) for c in executed.cells if c.cell_type == "code" for w in WIDGETS)
    assert views or not makes, "the notebook makes widgets but displayed no widget view"


def _output_text(nb: nbformat.NotebookNode) -> str:
    """Everything the executed notebook printed or displayed as text or markdown."""
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            data = output.get("data", {})
            parts += [data.get("text/markdown", ""), data.get("text/plain", "")]
    return "\n".join(parts)


def test_notebook_08_replays_the_traces_gpu_check_records(tmp_path: Path) -> None:
    """Without a GPU, notebook 08 replays the traces a GPU run of benchmarks/gpu_check.py records: made here by the
    script's own ``record_traces`` on a CPU (the same files, the same metadata), read through the ``traces``
    parameter. The path that shows a real GPU run on machines without one is run before any GPU trace exists, and
    it names the device the traces were recorded on."""
    papermill = pytest.importorskip("papermill")
    import importlib.util

    import torch

    from labkit.models.random import random_model

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    settings = gpu_check.Settings(torch.device("cpu"), quick=True)
    model = random_model(settings.model["arch"], settings.model["size"], seed=0, dtype=settings.dtype)
    traces = tmp_path / "traces"
    gpu_check.record_traces(model, settings, traces, bandwidth=2e10, part={})
    path = ROOT / "notebooks" / "08_on_a_gpu.ipynb"
    executed = papermill.execute_notebook(
        str(path),
        str(tmp_path / path.name),
        parameters={"device": "cpu", "traces": str(traces)},
        cwd=str(path.parent),
        kernel_name="python3",
        progress_bar=False,
        execution_timeout=300,
    )
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors
    text = _output_text(executed)
    # gpu_check.py ran on a CPU here: the notebook says so instead of calling its times a GPU's.
    assert re.search(
        rf"this notebook replays traces recorded on cpu \(.*\), not on a GPU \({re.escape(str(traces))}\)", text
    )
    assert re.search(r"a replay of traces recorded on cpu \(.*\), not on a GPU \(cpu", text)
    assert f"read from {traces}" in text and "recorded on a GPU" not in text
    assert "random-weight tiny (llama)" in text  # the trace's own description of its model
    assert re.search(r"Over \d+ decode steps, the floor came to \d+% of the measured step time", text)
