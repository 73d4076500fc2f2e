"""The ``labkit`` command: ``labkit demo`` steps an engine and prints what it did; ``labkit bench`` measures."""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.bench import main as bench_main
from labkit.report import StepReport

USAGE = """usage: labkit {demo,bench} [options]

  demo    step the engine through continuous and static batching and print what it did
  bench   serve a workload in several modes and compare throughput and latency

Run `labkit demo --help` or `labkit bench --help` for the options."""


def demo_prompts(count: int, vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Random prompts and a long tail of output lengths: most requests short, one in four long."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab_size) for _ in range(rng.randint(4, 24))] for _ in range(count)]
    lengths = [rng.randint(24, 40) if i % 4 == 3 else rng.randint(2, 8) for i in range(count)]
    return prompts, lengths


def run_demo(policy: str, *, requests: int, seed: int, console: Console | None, step_rows: int) -> list[StepReport]:
    """Run the demo workload under one policy; print one table row per step (up to ``step_rows``)."""
    config = EngineConfig(block_size=4, num_blocks=48, max_batch_tokens=64, max_num_seqs=6, policy=policy)
    engine = Engine(SimulatedModel(), config)
    prompts, lengths = demo_prompts(requests, engine.runner.vocab_size, seed)
    for prompt, n in zip(prompts, lengths, strict=True):
        engine.add_request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    table = Table(title=f"{policy} batching, step by step ({engine.device_name})")
    for column in ("step", "prefill", "decode", "wasted", "run", "wait", "KV cache blocks", "admitted", "finished"):
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
    if console is not None:
        console.print(table)
        if len(reports) > step_rows:
            console.print(f"... {len(reports) - step_rows} more steps\n")
    return reports


def kv_bar(report: StepReport, width: int = 12) -> str:
    """KV-cache use after the step as a small bar, e.g. ``██████░░░░░░ 24/48``."""
    used = report.num_blocks - report.num_free_blocks
    filled = round(width * used / report.num_blocks)
    return "█" * filled + "░" * (width - filled) + f" {used}/{report.num_blocks}"


def summarize(runs: dict[str, list[StepReport]], console: Console) -> None:
    """One row per policy: same requests, so the tokens are equal and only time and waste differ."""
    table = Table(title="continuous vs static on the same requests (simulated CPU time)")
    for column in ("policy", "steps", "time (s)", "tokens", "tokens/s", "wasted slots", "peak KV use", "vs static"):
        table.add_column(column, justify="right")
    rates = {}
    for policy, reports in runs.items():
        tokens = sum(r.num_generated_tokens for r in reports)
        rates[policy] = (tokens, reports[-1].end_time - reports[0].start_time)
    static_rate = rates["static"][0] / rates["static"][1]
    for policy, reports in runs.items():
        tokens, elapsed = rates[policy]
        table.add_row(
            policy,
            str(len(reports)),
            f"{elapsed:.1f}",
            str(tokens),
            f"{tokens / elapsed:.1f}",
            str(sum(r.wasted_slots for r in reports)),
            f"{max(r.kv_usage for r in reports):.0%}",
            f"{tokens / elapsed / static_rate:.2f}x",
        )
    console.print(table)


def _ids(ids: object) -> str:
    return ",".join(map(str, ids))


def demo_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="labkit demo",
        description="Step the engine through continuous and static batching on a simulated model.",
    )
    parser.add_argument("--requests", type=int, default=12, help="number of requests (default 12)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--steps", type=int, default=40, help="step rows to print per policy (default 40)")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    console = Console()
    runs = {
        policy: run_demo(policy, requests=args.requests, seed=args.seed, console=console, step_rows=args.steps)
        for policy in ("continuous", "static")
    }
    summarize(runs, console)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": demo_main, "bench": bench_main}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
