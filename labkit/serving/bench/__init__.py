"""``labkit bench``: serve one seeded workload in several ways and compare the numbers side by side.

A *mode* is one way of serving the workload: a function ``(workload, setup) -> Run`` that returns one
finished RequestOutput per request (with its timestamps) and, when it has them, step reports. Every
mode gets the same token-id prompts, the same greedy settings and a warm-up that is not timed, and is
measured by the same :mod:`labkit.serving.metrics` definitions, so the table compares batching strategies and
nothing else. Modes:

* ``labkit-continuous`` / ``labkit-static`` - labkit's engine with each batching policy.
* ``hf-generate`` - transformers ``model.generate`` on left-padded static batches in arrival order.
* ``hf-continuous`` - transformers' continuous-batching manager, per-request ``max_new_tokens``.
* ``vllm`` - vLLM's offline engine, where vLLM is installed (offline runs only).

Requests arrive all at once (offline) or at a rate (online); the transformers baselines are served
online too (each request submitted when due), vLLM only offline. Each mode runs ``repeats`` times,
modes alternating order between repeats; the table shows medians over the repeats. Several arrival
rates make a sweep: every mode at every rate, one table.

The package, in the order a bench runs:

* :mod:`~labkit.serving.bench.modes` - the modes, and what they share (:class:`BenchSetup`).
* :mod:`~labkit.serving.bench.checks` - what is refused before the first run, and why.
* :mod:`~labkit.serving.bench.loading` - the model a ``--model`` spec names; workloads as token ids.
* :mod:`~labkit.serving.bench.run` - the repeats, the medians, a failed mode recorded rather than fatal.
* :mod:`~labkit.serving.bench.report` - the tables and the JSON; :mod:`~labkit.serving.bench.html` - the plots.
* :mod:`~labkit.serving.bench.cli` - the command line.
"""

from labkit.serving.bench.checks import check_modes, check_output_paths, check_workload, expand_modes
from labkit.serving.bench.cli import build_parser, main
from labkit.serving.bench.loading import load_model, tokenize_workload
from labkit.serving.bench.modes import MODES, BenchSetup, ModeFn, labkit_continuous, labkit_static
from labkit.serving.bench.report import results_json, results_table, sweep_table
from labkit.serving.bench.run import BenchResult, median_metrics, run_bench

__all__ = [
    "MODES",
    "BenchResult",
    "BenchSetup",
    "ModeFn",
    "build_parser",
    "check_modes",
    "check_output_paths",
    "check_workload",
    "expand_modes",
    "labkit_continuous",
    "labkit_static",
    "load_model",
    "main",
    "median_metrics",
    "results_json",
    "results_table",
    "run_bench",
    "sweep_table",
    "tokenize_workload",
]
