"""The ``labkit`` command: ``labkit demo`` steps an engine and prints what it did; ``labkit bench`` measures;
``labkit check`` shows the exercises' progress."""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.core.report import StepReport, summarize_run
from labkit.core.request import RequestOutput
from labkit.exercises.command import main as check_main
from labkit.serving.bench.cli import main as bench_main

USAGE = """usage: labkit {demo,bench,check} [options]

  demo    step the engine through continuous and static batching and print what it did
  bench   serve a workload in several modes and compare throughput and latency
  check   check your exercises (exercises/exN_*.py) and show your progress

Run `labkit demo --help`, `labkit bench --help` or `labkit check --help` for the options."""


# Speakers of the bundled model's corpus: each prompt asks for one speech, which ends by itself (EOS).
SPEAKERS = (
    "ROMEO:", "JULIET:", "First Citizen:", "KING RICHARD III:", "MENENIUS:", "LADY ANNE:",
    "GLOUCESTER:", "Nurse:", "BRUTUS:", "HASTINGS:", "QUEEN ELIZABETH:", "MERCUTIO:",
)  # fmt: skip


@dataclass
class DemoSetup:
    """The model and the requests the demo serves, once per policy."""

    model: Any
    tokenizer: Any
    prompts: list[Any]
    params: list[SamplingParams]
    config: EngineConfig
    clock: str  # what the times in the summary are


def simulated_setup(requests: int, seed: int) -> DemoSetup:
    """Random prompts and a long tail of output lengths on the simulated model: one request in four is long."""
    rng = random.Random(seed)
    model = SimulatedModel()
    prompts = [[rng.randrange(2, model.vocab_size) for _ in range(rng.randint(4, 24))] for _ in range(requests)]
    lengths = [rng.randint(24, 40) if i % 4 == 3 else rng.randint(2, 8) for i in range(requests)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    config = EngineConfig(block_size=4, num_blocks=48, max_batch_tokens=64, max_num_seqs=6)
    return DemoSetup(model, None, prompts, params, config, "simulated CPU time")


def model_setup(name: str, requests: int, seed: int, device: str) -> DemoSetup:
    """Speaker prompts on a real model, sampled with a seed per request, so each speech ends at its own length."""
    from labkit.models import load  # imports torch and transformers

    model, tokenizer = load(name, device=device)
    prompts = [SPEAKERS[i % len(SPEAKERS)] + "\n" for i in range(requests)]
    params = [SamplingParams(max_new_tokens=120, temperature=0.8, seed=seed + i) for i in range(requests)]
    config = EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=64, max_num_seqs=6, device=device)
    return DemoSetup(model, tokenizer, prompts, params, config, "wall-clock time")


def run_demo(
    setup: DemoSetup, policy: str, console: Console, step_rows: int
) -> tuple[list[StepReport], list[RequestOutput]]:
    """Serve the demo's requests under one policy; print one table row per step (up to ``step_rows``)."""
    engine = Engine(setup.model, replace(setup.config, policy=policy), setup.tokenizer)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(setup.prompts, setup.params, strict=True)]
    table = compact_table(f"{policy} batching, step by step ({engine.device_name})")
    for column in ("step", "prefill", "decode", "wasted", "run", "wait", "KV blocks", "admitted", "finished"):
        table.add_column(column, justify="right")
    table.add_column("preempted", justify="right")
    reports = []
    while engine.has_unfinished():
        report = engine.step()
        reports.append(report)
        if len(reports) <= step_rows:
            table.add_row(
                str(report.step),
                str(report.num_prefill_tokens),
                str(report.num_decode_tokens),
                str(report.wasted_slots),
                str(report.num_running),
                str(report.num_waiting),
                kv_bar(report),
                _ids(report.admitted),
                _ids(report.finished),
                _ids(report.preempted),
            )
    console.print(table)
    if len(reports) > step_rows:
        console.print(f"... {len(reports) - step_rows} more steps\n")
    return reports, [engine.output(request_id) for request_id in ids]


def compact_table(title: str) -> Table:
    """A table whose columns are one space apart, with no rules between them: the demo fits an 80-column terminal."""
    return Table(title=title, box=box.SIMPLE_HEAD, padding=0, show_edge=False)


def kv_bar(report: StepReport, width: int = 8) -> str:
    """KV-cache use after the step as a small bar, e.g. ``████░░░░ 24/48``."""
    used = report.num_blocks - report.num_free_blocks
    filled = round(width * used / report.num_blocks)
    return "█" * filled + "░" * (width - filled) + f" {used}/{report.num_blocks}"


def summarize(
    runs: dict[str, list[StepReport]], outputs: dict[str, list[RequestOutput]], clock: str, console: Console
) -> None:
    """One row per policy: same requests, so the tokens are equal and only time and waste differ. Each run is
    timed from its first request's arrival to its last finish, as ``run_metrics`` times it."""
    table = compact_table(f"continuous vs static on the same requests ({clock})")
    table.caption = "batch: requests computed per step, on average"
    columns = ("policy", "steps", "time (s)", "tokens", "tokens/s", "batch", "wasted rows", "peak KV", "vs static")
    for column in columns:
        table.add_column(column, justify="right")
    summaries = [
        summarize_run(policy, reports, arrival_times=[o.metrics.arrival_time for o in outputs[policy]])
        for policy, reports in runs.items()
    ]
    static_rate = next(s.tokens_per_s for s in summaries if s.label == "static")
    for summary in summaries:
        table.add_row(
            summary.label,
            str(summary.steps),
            f"{summary.duration:.1f}",
            str(summary.generated_tokens),
            f"{summary.tokens_per_s:.1f}",
            f"{summary.mean_batch_size:.1f}",
            str(summary.wasted_slots),
            f"{summary.peak_kv_usage:.0%}",
            f"{summary.tokens_per_s / static_rate:.2f}x",
        )
    console.print(table)


def _ids(ids: object) -> str:
    return ",".join(map(str, ids))


def demo_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="labkit demo",
        description="Step the engine through continuous and static batching on the same requests and print"
        " what each step did (the first --steps of each policy).",
    )
    parser.add_argument(
        "--model",
        default="tiny-shakespeare",
        help="'sim' for the simulated model, or any name labkit.models.load accepts (default: the bundled"
        " tiny-shakespeare, offline)",
    )
    parser.add_argument(
        "--num-requests", "--requests", dest="num_requests", type=int, default=12, help="requests (default 12)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload and sampling seed (default 0)")
    parser.add_argument("--steps", type=int, default=30, help="step rows to print per policy (default 30; 0: none)")
    parser.add_argument("--device", default="auto", help="'auto' (CUDA if present), 'cpu' or 'cuda' (default auto)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; set explicitly)")
    args = parser.parse_args(argv)
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.steps < 0:
        parser.error(f"--steps must be >= 0, got {args.steps}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.model == "sim" and args.device != "auto":
        parser.error("--device chooses where a real model runs; the simulated model has none")
    console = Console()
    if args.model == "sim":
        setup = simulated_setup(args.num_requests, args.seed)
    else:
        import torch

        torch.set_num_threads(args.threads)
        try:
            setup = model_setup(args.model, args.num_requests, args.seed, args.device)
        except (OSError, ValueError, TypeError) as error:
            parser.error(str(error))
        console.print(f"{args.model} with torch on {args.threads} CPU thread(s)")
    runs, outputs = {}, {}
    for policy in ("continuous", "static"):
        runs[policy], outputs[policy] = run_demo(setup, policy, console, args.steps)
    summarize(runs, outputs, setup.clock, console)
    if setup.tokenizer is not None:
        for prompt, output in list(zip(setup.prompts, outputs["continuous"], strict=True))[:3]:
            console.print(
                f"[bold]{prompt.strip()}[/bold] ({len(output.output_token_ids)} tokens, {output.finish_reason})"
            )
            console.print(output.text.strip(), highlight=False, markup=False)
        same = all(
            a.output_token_ids == b.output_token_ids
            for a, b in zip(outputs["continuous"], outputs["static"], strict=True)
        )
        console.print(f"\nstatic batching produced the same tokens for every request: {'yes' if same else 'NO'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo_main, "bench": bench_main, "check": check_main}
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)  # asked for: stdout, as the subcommands' --help
        return 0
    if not argv or argv[0] not in commands:
        unknown = f"labkit: unknown command {argv[0]!r}\n" if argv else ""
        print(f"{unknown}{USAGE}", file=sys.stderr)
        return 2
    try:
        return commands[argv[0]](argv[1:])
    except KeyboardInterrupt:  # Ctrl-C in a terminal: a line, not a traceback; 130 is how shells report it
        print(f"labkit {argv[0]}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
