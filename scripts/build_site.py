"""Render the executed course as static HTML: one page per notebook in notebooks/ and exercises/, and an index.

    python scripts/build_site.py              # from the committed outputs, into site/
    python scripts/build_site.py --execute    # run every notebook first (as committed, defaults)
    python scripts/build_site.py --out DIR

Pages need no kernel. Two kinds of output are made static on the way:

* plotly figures saved as ``application/vnd.plotly.v1+json`` (what ``fig.show()`` leaves in a notebook) get an
  HTML rendering beside them, drawn by plotly.js from its CDN;
* widget views whose state was not saved (the course saves none) are dropped, so the page shows the static
  figure that labkit's widgets display beside every view.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path

import nbformat
import plotly.io as pio
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import run_notebooks  # noqa: E402
from notebook_headers import notebook_paths  # noqa: E402

PLOTLY_MIMETYPE = "application/vnd.plotly.v1+json"
WIDGET_VIEW_MIMETYPE = "application/vnd.jupyter.widget-view+json"


def make_static(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Give plotly outputs an HTML rendering and drop widget views that have no saved state (in place)."""
    has_widget_state = "widgets" in nb.metadata
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data is None:
                continue
            if PLOTLY_MIMETYPE in data and "text/html" not in data:
                figure = pio.from_json(json.dumps(data[PLOTLY_MIMETYPE]), skip_invalid=True)
                data["text/html"] = figure.to_html(full_html=False, include_plotlyjs="cdn")
            if WIDGET_VIEW_MIMETYPE in data and not has_widget_state:
                del data[WIDGET_VIEW_MIMETYPE]
    return nb


def title_of(nb: nbformat.NotebookNode, fallback: str) -> str:
    first = nb.cells[0].source.splitlines() if nb.cells else []
    return first[0].lstrip("# ").strip() if first and first[0].startswith("#") else fallback


def build(out: Path, execute: bool = False, timeout: int = 300) -> list[Path]:
    """Write one HTML page per course notebook and an index.html into ``out``; return the pages."""
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab")
    pages, entries = [], []
    for path in notebook_paths(ROOT):
        nb = nbformat.read(path, as_version=4)
        if execute:
            run_notebooks.execute(nb, path, timeout)
        relative = path.relative_to(ROOT)
        body, _ = exporter.from_notebook_node(make_static(nb))
        page = out / relative.with_suffix(".html")
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(body)
        pages.append(page)
        entries.append((relative.with_suffix(".html").as_posix(), title_of(nb, path.stem), relative.parent.name))
    items = "\n".join(
        f'<li><a href="{html.escape(href)}">{html.escape(title)}</a> <small>({folder})</small></li>'
        for href, title, folder in entries
    )
    (out / "index.html").write_text(
        "<!doctype html>\n<meta charset=utf-8>\n<title>labkit: the course</title>\n"
        "<h1>labkit: how LLM inference servers batch requests</h1>\n"
        f"<p>The course notebooks, executed.</p>\n<ul>\n{items}\n</ul>\n"
    )
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "site", help="output folder (default: site/)")
    parser.add_argument("--execute", action="store_true", help="run every notebook before rendering it")
    args = parser.parse_args(argv)
    pages = build(args.out, execute=args.execute)
    print(f"wrote {len(pages)} pages and {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
