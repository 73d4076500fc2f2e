"""``labkit bench``: serve one seeded workload in several ways and compare the numbers side by side.

A *mode* is one way of serving the workload: a function ``(workload, setup) -> Run`` that returns one
finished RequestOutput per request (with its timestamps) and, when it has them, step reports. Every
mode gets the same token-id prompts and is measured by the same :mod:`labkit.metrics` definitions,
so the table compares batching strategies and nothing else. Other ways of serving (transformers'
padded ``generate``, its continuous batching, vLLM) plug in by adding a function to :data:`MODES`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from labkit.config import EngineConfig
from labkit.engine import Engine
from labkit.metrics import GpuMonitor, Run, RunMetrics, parse_targets, request_stats, run_metrics, step_stats
from labkit.online import run_workload
from labkit.request import SamplingParams
from labkit.sim import COST_PRESETS, SimulatedModel
from labkit.workloads import WORKLOADS, WorkloadRequest, make_workload

BENCH_VERSION = 1


@dataclass
class BenchSetup:
    """What every mode of one bench shares: the model, its tokenizer (None for token-id models), the engine knobs."""

    model: Any
    tokenizer: Any
    config: EngineConfig
    ignore_eos: bool = True

    @property
    def simulated(self) -> bool:
        return isinstance(self.model, SimulatedModel)


@dataclass
class BenchResult:
    """One mode's run and its metrics."""

    mode: str
    run: Run
    metrics: RunMetrics


ModeFn = Callable[[Sequence[WorkloadRequest], BenchSetup], Run]


# ---------------------------------------------------------------------------------------------- modes
def run_labkit(workload: Sequence[WorkloadRequest], setup: BenchSetup, policy: str) -> Run:
    """Serve the workload on a fresh labkit Engine with the given batching policy."""
    engine = Engine(setup.model, replace(setup.config, policy=policy))
    if not setup.simulated:  # first steps on a real model pay one-off costs (allocation, kernel choice)
        engine.generate([[3, 4, 5, 6]] * 2, SamplingParams(max_new_tokens=4, ignore_eos=True))
    return run_workload(engine, workload, ignore_eos=setup.ignore_eos)


def labkit_continuous(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """labkit's engine with continuous batching (and chunked prefill unless the config turns it off)."""
    return run_labkit(workload, setup, "continuous")


def labkit_static(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """labkit's engine with static batching: a new batch only when the previous one is fully done."""
    return run_labkit(workload, setup, "static")


MODES: dict[str, ModeFn] = {
    "labkit-continuous": labkit_continuous,
    "labkit-static": labkit_static,
}


# ---------------------------------------------------------------------------------------------- running
def run_bench(
    setup: BenchSetup,
    workload: Sequence[WorkloadRequest],
    modes: Sequence[str],
    *,
    targets: str | dict[str, float] | None = None,
) -> list[BenchResult]:
    """Serve ``workload`` (token-id prompts) once per mode, in order; measure each run."""
    if isinstance(targets, str):
        targets = parse_targets(targets)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; choose from {sorted(MODES)}")
    if not modes:
        raise ValueError("no modes to run")
    for item in workload:
        if isinstance(item.prompt, str):
            raise TypeError("bench prompts must be token ids; convert text prompts with tokenize_workload")
    results = []
    for mode in modes:
        with GpuMonitor() as gpu:
            run = MODES[mode](workload, setup)
        metrics = run_metrics(
            run.outputs,
            run.reports,
            targets=targets,
            peak_gpu_memory_bytes=gpu.peak_memory_bytes,
            gpu_utilization=gpu.utilization,
        )
        results.append(BenchResult(mode, run, metrics))
    return results


def tokenize_workload(workload: Sequence[WorkloadRequest], tokenizer: Any) -> list[WorkloadRequest]:
    """The same workload with text prompts turned into token ids, so every mode sees identical tokens."""
    return [
        replace(r, prompt=tokenizer.encode(r.prompt, add_special_tokens=False)) if isinstance(r.prompt, str) else r
        for r in workload
    ]


def load_model(spec: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a spec: ``sim`` or ``sim:<cost preset>`` (simulated), ``random:<size>``
    (a random-weight transformers model, token-id prompts), or a transformers model directory or cached
    hub id (loaded offline, text prompts)."""
    kind, _, arg = spec.partition(":")
    if kind == "sim":
        return SimulatedModel(cost=arg or "cpu"), None
    if kind == "random":
        from labkit.models.random import random_model

        return random_model(size=arg or "tiny"), None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(spec), AutoTokenizer.from_pretrained(spec)


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
    import torch

    from labkit.runner import resolve_device

    device = resolve_device(setup.config.device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def vocab_size(model: Any) -> int:
    if isinstance(model, SimulatedModel):
        return model.vocab_size
    return model.get_input_embeddings().num_embeddings


# ---------------------------------------------------------------------------------------------- output
def results_table(results: Sequence[BenchResult], title: str = "labkit bench") -> Table:
    """One column per mode, one row per number: throughput, latency percentiles, goodput, cache use."""
    table = Table(title=title)
    table.add_column("metric")
    for result in results:
        table.add_column(result.mode, justify="right")
    for label, cell in TABLE_ROWS:
        table.add_row(label, *(cell(r.metrics) for r in results))
    return table


def _latency(name: str, stat: str) -> Callable[[RunMetrics], str]:
    def cell(m: RunMetrics) -> str:
        summary = getattr(m, name)
        return "-" if summary is None else _seconds(getattr(summary, stat))

    return cell


TABLE_ROWS: list[tuple[str, Callable[[RunMetrics], str]]] = [
    ("requests/s", lambda m: f"{m.request_throughput:.2f}"),
    ("output tokens/s", lambda m: f"{m.output_throughput:.1f}"),
    ("total tokens/s", lambda m: f"{m.total_throughput:.1f}"),
    ("duration", lambda m: _seconds(m.duration)),
    ("queue mean", _latency("queue_time", "mean")),
    *(
        (f"{label} {stat}", _latency(name, stat))
        for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "e2e"))
        for stat in ("mean", "median", "p99")
    ),
    ("goodput", lambda m: "-" if m.goodput is None else f"{m.goodput:.2f} req/s ({m.slo_attainment:.0%})"),
    ("peak KV usage", lambda m: "-" if m.peak_kv_usage is None else f"{m.peak_kv_usage:.1%}"),
    ("preemptions", lambda m: str(m.total_preemptions)),
    ("wasted slots", lambda m: "-" if m.wasted_slots is None else str(m.wasted_slots)),
    ("steps", lambda m: "-" if m.num_steps is None else str(m.num_steps)),
    (
        "peak GPU memory",
        lambda m: "-" if m.peak_gpu_memory_bytes is None else f"{m.peak_gpu_memory_bytes / 2**30:.2f} GiB",
    ),
    ("GPU utilisation", lambda m: "-" if m.gpu_utilization is None else f"{m.gpu_utilization:.0f}%"),
]


def results_json(results: Sequence[BenchResult], meta: dict[str, Any]) -> dict[str, Any]:
    """Everything a report needs to redraw the comparison: run metrics, per-request and per-step records."""
    return {
        "version": BENCH_VERSION,
        "meta": meta,
        "runs": [
            {
                "mode": r.mode,
                "metrics": r.metrics.to_dict(),
                "requests": [request_stats(o).to_dict() for o in r.run.outputs],
                "steps": [asdict(step_stats(s)) for s in r.run.reports],
            }
            for r in results
        ],
    }


def describe_workload(workload: Sequence[WorkloadRequest]) -> str:
    prompts = [len(r.prompt) for r in workload]
    outputs = [r.max_new_tokens for r in workload]
    last = max(r.arrival_time for r in workload)
    arrivals = "all at t=0 (offline)" if last == 0 else f"arrivals over {last:.1f} s"
    return (
        f"{len(workload)} requests, prompts {min(prompts)}-{max(prompts)} tokens (mean {_mean(prompts):.0f}),"
        f" outputs {min(outputs)}-{max(outputs)} (mean {_mean(outputs):.0f}), {arrivals}"
    )


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values)


# ---------------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="labkit bench",
        description="Serve one seeded workload in several ways and compare throughput and latency.",
    )
    parser.add_argument(
        "--model",
        default="sim",
        help=f"'sim' or 'sim:PRESET' (simulated; presets: {', '.join(COST_PRESETS)}), 'random:SIZE' (random-weight"
        " transformers model), or a local transformers model directory (default: sim)",
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), metavar="MODE", help=f"from {', '.join(MODES)}")
    parser.add_argument("--workload", default="long-tail", choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=None, help="requests in the workload (default 32)")
    parser.add_argument("--rate", type=float, default=math.inf, help="arrivals per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=_pair, help="LO,HI prompt tokens (uniform, long-tail)")
    parser.add_argument("--output-len", type=_pair, help="LO,HI new tokens (uniform, long-tail, shared-prefix)")
    parser.add_argument("--long-output-len", type=int, help="new tokens of the long requests (long-tail)")
    parser.add_argument("--prefix-len", type=int, help="shared system prompt tokens (shared-prefix)")
    parser.add_argument("--suffix-len", type=_pair, help="LO,HI own prompt tokens (shared-prefix)")
    parser.add_argument(
        "--max-len", type=int, help="clip lengths to this (sharegpt-like; default min(1024, --max-batch-tokens))"
    )
    parser.add_argument("--targets", help="latency targets for goodput, e.g. 'ttft<=0.5s,tpot<=0.05s'")
    parser.add_argument("--respect-eos", action="store_true", help="let EOS end requests early")
    defaults = EngineConfig()
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks (default: sized by the runner)")
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--no-chunked-prefill", action="store_true")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (real models)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (real models)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, help="write the results (metrics, per-request, per-step) here")
    return parser


WORKLOAD_OPTIONS = ("prompt_len", "output_len", "long_output_len", "prefix_len", "suffix_len", "max_len")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        config = EngineConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            chunked_prefill=not args.no_chunked_prefill,
            device=args.device,
            dtype=args.dtype,
        )
        targets = parse_targets(args.targets) if args.targets else None
        unknown = [m for m in args.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown mode {unknown[0]!r}; choose from {sorted(MODES)}")
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        model, tokenizer = load_model(args.model)
        options = {k: getattr(args, k) for k in WORKLOAD_OPTIONS if getattr(args, k) is not None}
        if args.workload == "sharegpt-like" and "max_len" not in options:  # static batching prefills in one step
            options["max_len"] = min(1024, config.max_batch_tokens)
        prompt_source = {"tokenizer": tokenizer} if tokenizer is not None else {"vocab_size": vocab_size(model)}
        workload = make_workload(
            args.workload,
            args.num_requests,
            seed=args.seed,
            rate=args.rate,
            burstiness=args.burstiness,
            special_ids=special_token_ids(model, tokenizer),
            **prompt_source,
            **options,
        )
        workload = tokenize_workload(workload, tokenizer)
        setup = BenchSetup(model, tokenizer, config, ignore_eos=not args.respect_eos)
        console.print(f"[bold]{args.workload}[/bold]: {describe_workload(workload)}")
        results = run_bench(setup, workload, args.modes, targets=targets)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"labkit bench: error: {error}", file=sys.stderr)
        return 2
    device = device_name(setup)
    clock = "simulated seconds" if setup.simulated else "wall-clock seconds"
    console.print(results_table(results, title=f"labkit bench: {args.model} on {device}, {args.workload} ({clock})"))
    if args.json is not None:
        meta = {
            "model": args.model,
            "device": device,
            "clock": clock,
            "workload": args.workload,
            "workload_options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
            "num_requests": len(workload),
            "rate": None if math.isinf(args.rate) else args.rate,
            "burstiness": args.burstiness,
            "seed": args.seed,
            "ignore_eos": setup.ignore_eos,
            "config": {k: v for k, v in asdict(config).items() if k != "dtype"} | {"dtype": args.dtype},
        }
        args.json.write_text(json.dumps(results_json(results, meta), indent=1))
        console.print(f"results written to {args.json}")
    return 0


def _pair(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two ints), got {text!r}") from None
    return low, high


if __name__ == "__main__":
    sys.exit(main())
