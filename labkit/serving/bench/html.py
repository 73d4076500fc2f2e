"""A self-contained HTML report of a ``labkit bench`` run: the plots that show *why* the numbers differ.

The table says continuous batching finished sooner; the plots show how. Throughput over time shows
static batches draining to a trickle while one long request finishes; latency CDFs show the whole
distribution behind each percentile; KV-cache usage and the batch's make-up per step (prefill, decode
and wasted rows) show what the engine was doing. The report is drawn from the bench's JSON (see
:func:`labkit.serving.bench.report.results_json`), so a saved run can be drawn again later, and plotly.js is
embedded in the page, so it opens offline. A mode that failed is listed with its reason and left out of the plots.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from labkit.serving.bench.report import rate_label, seconds_label

THROUGHPUT_BINS = 50  # time bins across the longest run
DASHES = ("solid", "dot", "dash", "dashdot", "longdash", "longdashdot")  # one per arrival rate in a sweep
CLIP_FACTOR = 3  # batch-composition axis: up to this many times the largest decode step
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end latency"))
PLOTLY_HINT = "pip install plotly (or: pip install 'labkit-batching[widgets]')"


def require_plotly() -> None:
    """ImportError, saying how to install it, when plotly is missing."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        raise ImportError(f"the HTML report needs plotly, which is not installed: {PLOTLY_HINT}") from None


def write_html(path: str | Path, data: dict[str, Any]) -> Path:
    """Write the report for a bench's JSON ``data`` to ``path``; return the path."""
    path = Path(path)
    path.write_text(report_html(data), encoding="utf-8")
    return path


def load_and_write(json_path: str | Path, html_path: str | Path) -> Path:
    """Draw the report of a bench saved with ``labkit bench --json``."""
    return write_html(html_path, json.loads(Path(json_path).read_text()))


def report_html(data: dict[str, Any]) -> str:
    """The whole page: a summary, then one plot per question, with plotly.js inlined once."""
    require_plotly()
    if not data["runs"]:
        raise ValueError("the bench data has no runs to report")
    summary = _summary_table(data["runs"], _labels(data["runs"]))
    runs = [run for run in data["runs"] if run.get("error") is None]  # a failed mode has nothing to plot
    labels = _labels(runs)
    styles = _line_styles(runs)
    figures = (
        []
        if not runs
        else [
            ("Output throughput over time", throughput_figure(runs, labels, styles)),
            ("Latency distributions (fraction of requests at or below each latency)", cdf_figure(runs, labels, styles)),
        ]
    )
    if len({run["rate"] for run in runs}) > 1:
        figures.insert(0, ("Sweep: throughput and tail latency against arrival rate", sweep_figure(runs, styles)))
    stepped = [i for i, run in enumerate(runs) if run["steps"]]  # baselines report no steps
    if stepped:
        picked = ([runs[i] for i in stepped], [labels[i] for i in stepped], [styles[i] for i in stepped])
        figures.append(("KV-cache usage over time (labkit modes)", kv_figure(*picked)))
        figures.append(("Batch composition per step (labkit modes)", composition_figure(picked[0], picked[1])))
    parts = []
    for index, (heading, figure) in enumerate(figures):
        plot = figure.to_html(full_html=False, include_plotlyjs=index == 0, default_width="100%")
        parts.append(f"<h2>{html.escape(heading)}</h2>\n{plot}")
    meta = data.get("meta", {})
    title = f"labkit bench: {meta.get('model', '?')} on {meta.get('device', '?')}, {meta.get('workload', '?')}"
    return PAGE.format(
        title=html.escape(title),
        meta=_meta_table(meta),
        summary=summary,
        plots="\n".join(parts),
    )


# ---------------------------------------------------------------------------------------------- figures
def throughput_figure(runs: Sequence[dict[str, Any]], labels: list[str], styles: list[dict[str, str]]) -> Any:
    """Output tokens per second in equal time bins, from every token's timestamp."""
    import plotly.graph_objects as go

    end = max((t for run in runs for r in run["requests"] for t in r["token_times"]), default=0.0)
    width = end / THROUGHPUT_BINS if end > 0 else 1.0
    figure = go.Figure()
    for run, label, style in zip(runs, labels, styles, strict=True):
        counts = [0] * THROUGHPUT_BINS
        for request in run["requests"]:
            for t in request["token_times"]:
                counts[min(int(t / width), THROUGHPUT_BINS - 1)] += 1
        last = max((t for r in run["requests"] for t in r["token_times"]), default=0.0)
        used = min(THROUGHPUT_BINS, int(last / width) + 1)
        figure.add_scatter(
            x=[(i + 0.5) * width for i in range(used)],
            y=[c / width for c in counts[:used]],
            mode="lines",
            line={"shape": "hv", **style},
            name=label,
        )
    return _layout(figure, "seconds since the first arrival", "output tokens / s")


def cdf_figure(runs: Sequence[dict[str, Any]], labels: list[str], styles: list[dict[str, str]]) -> Any:
    """Empirical CDFs of TTFT, TPOT and end-to-end latency, one line per run."""
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=len(LATENCIES), subplot_titles=[title for _, title in LATENCIES])
    for col, (key, _) in enumerate(LATENCIES, start=1):
        for run, label, style in zip(runs, labels, styles, strict=True):
            values = sorted(r[key] for r in run["requests"] if r[key] is not None)
            if not values:
                continue
            figure.add_scatter(
                x=values,
                y=[(i + 1) / len(values) for i in range(len(values))],
                mode="lines",
                line={"shape": "hv", **style},
                name=label,
                legendgroup=label,
                showlegend=col == 1,
                row=1,
                col=col,
            )
        figure.update_xaxes(title_text="seconds", row=1, col=col)
    figure.update_yaxes(title_text="fraction of requests", range=[0, 1.02], row=1, col=1)
    return _layout(figure)


def kv_figure(runs: Sequence[dict[str, Any]], labels: list[str], styles: list[dict[str, str]]) -> Any:
    """Fraction of KV-cache blocks in use after each step."""
    import plotly.graph_objects as go

    figure = go.Figure()
    for run, label, style in zip(runs, labels, styles, strict=True):
        steps = run["steps"]
        figure.add_scatter(
            x=[s["start_time"] + s["step_time"] for s in steps],
            y=[s["kv_usage"] for s in steps],
            mode="lines",
            line={"shape": "hv", **style},
            name=label,
        )
    figure.update_yaxes(tickformat=".1%", rangemode="tozero")
    return _layout(figure, "seconds since the first arrival", "KV blocks in use")


def composition_figure(runs: Sequence[dict[str, Any]], labels: list[str]) -> Any:
    """Stacked bars per step: prefill tokens, decode tokens and wasted rows (static batching's padding)."""
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=len(runs), cols=1, subplot_titles=labels, vertical_spacing=0.25 / len(runs))
    kinds = (("prefill_tokens", "prefill", "#1f77b4"), ("decode_tokens", "decode", "#2ca02c"))
    kinds += (("wasted_slots", "wasted (padding)", "#d62728"),)
    for row, run in enumerate(runs, start=1):
        steps = run["steps"]
        # A prefill step can be a hundred times taller than a decode step: clip the axis so decodes stay visible.
        top = max(s["prefill_tokens"] + s["decode_tokens"] + s["wasted_slots"] for s in steps)
        decode_steps = [s["decode_tokens"] + s["wasted_slots"] for s in steps if s["prefill_tokens"] == 0]
        clip = CLIP_FACTOR * max(decode_steps, default=top)
        if top > clip:
            figure.update_yaxes(range=[0, clip], row=row, col=1)
            note = f"prefill steps reach {top} tokens (axis clipped; hover for values)"
            figure.add_annotation(
                text=note, xref="x domain", yref="y domain", x=1, y=1, showarrow=False, row=row, col=1
            )
        for key, name, color in kinds:
            figure.add_bar(
                x=[s["step"] for s in steps],
                y=[s[key] for s in steps],
                name=name,
                marker={"color": color, "line": {"width": 0}},
                legendgroup=name,
                showlegend=row == 1,
                row=row,
                col=1,
            )
        figure.update_yaxes(title_text="tokens", row=row, col=1)
    figure.update_xaxes(title_text="step", row=len(runs), col=1)
    figure.update_layout(barmode="stack", bargap=0, height=260 * len(runs) + 80)
    return _layout(figure)


def sweep_figure(runs: Sequence[dict[str, Any]], styles: list[dict[str, str]]) -> Any:
    """Per mode against arrival rate: output throughput, TTFT p90 and e2e p90 (where static batching blows up)."""
    from plotly.subplots import make_subplots

    panels = (("output tokens/s", None), ("TTFT p90 (s)", "ttft"), ("e2e p90 (s)", "e2e"))
    figure = make_subplots(rows=1, cols=len(panels), subplot_titles=[title for title, _ in panels])
    color_of = {run["mode"]: style["color"] for run, style in zip(runs, styles, strict=True)}
    for mode in dict.fromkeys(run["mode"] for run in runs):
        points = sorted(
            (run["rate"] if run["rate"] is not None else float("inf"), run["metrics"])
            for run in runs
            if run["mode"] == mode
        )
        points = [(rate, m) for rate, m in points if rate != float("inf")]  # an offline run has no rate to plot
        for col, (_, key) in enumerate(panels, start=1):
            y = [m["output_throughput"] if key is None else (m[key] or {}).get("p90") for _, m in points]
            figure.add_scatter(
                x=[rate for rate, _ in points],
                y=y,
                mode="lines+markers",
                line={"color": color_of[mode]},
                name=mode,
                legendgroup=mode,
                showlegend=col == 1,
                row=1,
                col=col,
            )
            figure.update_xaxes(title_text="arrivals / s", row=1, col=col)
    return _layout(figure)


# ---------------------------------------------------------------------------------------------- helpers
def _labels(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Mode names, with the rate added when the bench swept several rates."""
    if len({run["rate"] for run in runs}) == 1:
        return [run["mode"] for run in runs]
    return [f"{run['mode']} @ {rate_label(run['rate'])}" for run in runs]


def _line_styles(runs: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """One color per mode and one dash pattern per rate, the same in every plot."""
    from plotly.colors import qualitative

    modes = list(dict.fromkeys(run["mode"] for run in runs))
    rates = list(dict.fromkeys(run["rate"] for run in runs))
    return [
        {
            "color": qualitative.Plotly[modes.index(run["mode"]) % len(qualitative.Plotly)],
            "dash": DASHES[rates.index(run["rate"]) % len(DASHES)],
        }
        for run in runs
    ]


def _layout(figure: Any, x_title: str | None = None, y_title: str | None = None) -> Any:
    figure.update_layout(template="plotly_white", margin={"l": 60, "r": 20, "t": 40, "b": 50}, hovermode="closest")
    if x_title:
        figure.update_xaxes(title_text=x_title)
    if y_title:
        figure.update_yaxes(title_text=y_title)
    return figure


def _stat(summary: dict[str, float] | None, stat: str) -> str:
    return seconds_label(None if summary is None else summary[stat])


def _summary_table(runs: Sequence[dict[str, Any]], labels: list[str]) -> str:
    header = ("run", "req/s", "out tok/s", "TTFT p50", "TTFT p90", "TPOT p90", "e2e p90", "peak KV")
    rows = []
    for run, label in zip(runs, labels, strict=True):
        m = run["metrics"]
        if m is None:
            failed = html.escape(f"failed: {run.get('error')}")
            rows.append(f"<tr><td>{html.escape(label)}</td><td colspan='{len(header) - 1}'>{failed}</td></tr>")
            continue
        kv = "-" if m["peak_kv_usage"] is None else f"{m['peak_kv_usage']:.0%}"
        cells = (
            label,
            f"{m['request_throughput']:.2f}",
            f"{m['output_throughput']:.0f}",
            _stat(m["ttft"], "median"),
            _stat(m["ttft"], "p90"),
            _stat(m["tpot"], "p90"),
            _stat(m["e2e"], "p90"),
            kv,
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _meta_table(meta: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><th>{html.escape(str(key))}</th><td>{html.escape(json.dumps(value))}</td></tr>"
        for key, value in meta.items()
    )
    return f"<table class='meta'>{rows}</table>"


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.7em; text-align: right; }}
th {{ background: #f4f4f4; }}
table.meta th, table.meta td, td:first-child {{ text-align: left; }}
h2 {{ margin-top: 2em; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>Numbers are medians over the repeats; plots show the median run of each mode. Times are seconds from the
run's first arrival.</p>
{summary}
<details><summary>settings</summary>{meta}</details>
{plots}
</body>
</html>
"""
