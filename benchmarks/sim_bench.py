"""Scale benchmark of the engine core: ten thousand simulated requests through the real scheduler, no torch.

Workload (seeded, all requests arrive at once):

* prompts: log-normal lengths, the "sharegpt-like" workload of ``labkit.serving.workloads`` (mean about 161 tokens,
  clipped to 1024);
* outputs: the SimulatedModel's long tail. Each generated token is EOS with probability
  ``1 / --mean-output-len`` (default 128), so output lengths are geometric: most are short, a few are
  five or six times the mean. ``max_new_tokens`` (default 1024) caps them. Requests do not know their
  lengths in advance, so a static batch runs until its longest member stops.

Simulating the static policy takes many more steps (every batch lasts as long as its longest member), so it
gets ``--static-requests`` requests (default 2,000, the first ones of the same workload); when that is fewer
than ``--requests``, continuous batching also runs on that same subset, for a like-for-like comparison.

Columns: wall and CPU time of this process (one thread, pure Python: adding the requests and stepping the
engine to the end), engine steps, simulated time, generated tokens, simulated throughput from the cost model
(``--cost``, default "h200"), mean rows computed per step, preemptions, and wasted slots (static padding and
dead rows). A static batch is small as well as slow: its prompts, padded to the longest, must fit
``max_batch_tokens`` in one step.

Run: ``python benchmarks/sim_bench.py [--requests 10000] [--policy both|continuous|static]``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.core.sim import COST_PRESETS
from labkit.serving.workloads import make_workload


@dataclass
class BenchRow:
    """One policy's run: what the machine spent (wall, CPU) and what the simulated server did."""

    policy: str
    num_requests: int
    wall_s: float
    cpu_s: float
    steps: int
    simulated_s: float
    generated_tokens: int
    rows_computed: int
    preemptions: int
    wasted_slots: int


def make_prompts(num_requests: int, vocab_size: int, seed: int) -> list[list[int]]:
    workload = make_workload("sharegpt-like", num_requests, seed=seed, vocab_size=vocab_size, special_ids={0, 1})
    return [request.prompt for request in workload]


def run(policy: str, prompts: list[list[int]], model: SimulatedModel, args: argparse.Namespace) -> BenchRow:
    """Add every prompt, then step the engine until all requests are done."""
    config = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        policy=policy,
    )
    engine = Engine(model, config)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    steps = rows = preemptions = wasted = 0
    wall, cpu = time.perf_counter(), time.process_time()
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        report = engine.step()
        steps += 1
        rows += len(report.scheduled) + len(report.padding)
        preemptions += len(report.preempted)
        wasted += report.wasted_slots
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    generated = sum(len(request.output_token_ids) for request in engine.requests.values())
    return BenchRow(policy, len(prompts), wall, cpu, steps, engine.clock(), generated, rows, preemptions, wasted)


def results_table(rows: list[BenchRow], title: str) -> Table:
    table = Table(title=title)
    table.add_column("policy")
    for column in ("requests", "wall s", "CPU s", "steps", "sim s", "tokens", "sim tok/s", "sim req/s"):
        table.add_column(column, justify="right")
    for column in ("rows/step", "preempted", "wasted"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.policy,
            f"{row.num_requests:,}",
            f"{row.wall_s:.2f}",
            f"{row.cpu_s:.2f}",
            f"{row.steps:,}",
            f"{row.simulated_s:.2f}",
            f"{row.generated_tokens:,}",
            f"{row.generated_tokens / row.simulated_s:,.0f}",
            f"{row.num_requests / row.simulated_s:,.1f}",
            f"{row.rows_computed / row.steps:.1f}",
            f"{row.preemptions:,}",
            f"{row.wasted_slots:,}",
        )
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests for the continuous run")
    parser.add_argument("--policy", choices=("both", "continuous", "static"), default="both")
    parser.add_argument("--static-requests", type=int, default=2_000, help="requests for the static run (with both)")
    parser.add_argument("--mean-output-len", type=float, default=128.0, help="mean of the geometric output lengths")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--cost", choices=sorted(COST_PRESETS), default="h200", help="cost model of a step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("requests", "static_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:  # every other bad value, named as the engine names it, before anything runs
        model = SimulatedModel(mean_output_len=args.mean_output_len, cost=args.cost, seed=args.seed)
        SamplingParams(max_new_tokens=args.max_new_tokens)
        EngineConfig(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
        )
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    prompts = make_prompts(args.requests, model.vocab_size, args.seed)
    console = Console()
    if not console.is_terminal:  # piped to a file: do not squeeze the table into 80 columns
        console = Console(width=150)
    rows = []
    if args.policy in ("both", "continuous"):
        rows.append(run("continuous", prompts, model, args))
    if args.policy == "static":
        rows.append(run("static", prompts, model, args))
    if args.policy == "both":
        subset = prompts[: args.static_requests]
        if len(subset) < len(prompts):
            rows.append(run("continuous", subset, model, args))
        rows.append(run("static", subset, model, args))
    title = (
        f"Simulated serving, {args.cost} cost model: {args.num_blocks} blocks x {args.block_size} slots,"
        f" max_batch_tokens={args.max_batch_tokens}, max_num_seqs={args.max_num_seqs};\n"
        f"log-normal prompts, geometric outputs with mean {args.mean_output_len:g} (cap {args.max_new_tokens})"
    )
    console.print(results_table(rows, title))


if __name__ == "__main__":
    main()
