"""What a GPU step costs the host: the engine's Python work per step, with the forward pass replaced by nothing.

On a GPU, a decode step of a 0.5B model reads about a gigabyte of weights plus its KV cache: under a
millisecond on an H200. Everything Python does around it (plan the step, build its inputs, read the sampled
tokens, commit, report) runs on the host before and after, and does not overlap with it. This benchmark
measures that part on any machine: the Triton attention path and CUDA-graph bookkeeping run as on a GPU
(graph "replays" call the forward on the same static buffers), but the forward returns zero logits at once.
What it prints is the floor under a GPU step's time on this host.

Tables:

* decode steps at batch 8, 64 and 256 with 100- and 800-token contexts: host milliseconds per step, per
  request, and by phase: the scheduler's plan, the runner (inputs, launch, sampling) and the commit with the
  step report; and per step with async scheduling (``EngineConfig(async_scheduling=True)``), where this host
  work overlaps the GPU's instead of adding to it, so that a GPU step takes the longer of the two;
* the nano-vllm benchmark (256 requests, prompt and output lengths uniform in 100..1024, all at once) served
  end to end, its step reports kept (as a Recorder or a benchmark keeps them), with Python's cycle collector
  as it is and with the heap frozen (``labkit.serving.metrics.frozen_heap``): seconds, output tokens per second
  of host time, and the time spent in full collections.

Threads: torch on 1 thread. Run: ``python benchmarks/host_bench.py [--steps 40] [--repeats 5]`` (about 35 s;
``--quick``: one small shape and 16 requests, a few seconds, which CI runs).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton path on a CPU (no kernel runs: the forward is a no-op)

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from labkit import Engine, EngineConfig, SamplingParams
from labkit.core.blocks import blocks_for
from labkit.models.random import random_model
from labkit.runtime.runner import ModelRunner
from labkit.serving.metrics import frozen_heap


class HostOnlyRunner(ModelRunner):
    """labkit's runner with the model's forward pass replaced by zero logits: only the host's work is left."""

    def _forward(self, input_ids: torch.Tensor, batch: Any, keep: torch.Tensor | int) -> torch.Tensor:
        rows = input_ids.shape[1] if isinstance(keep, int) else keep.shape[0]
        return torch.zeros((rows, 8))


class HostOnlyModel:
    """A model whose engine gets a HostOnlyRunner (an engine asks a model with ``make_runner`` for its runner)."""

    def __init__(self) -> None:
        self.model = random_model("llama", "tiny", seed=0)

    def make_runner(self, config: EngineConfig) -> HostOnlyRunner:
        return HostOnlyRunner(self.model, config)


def engine_for(batch: int, num_blocks: int, async_scheduling: bool = False) -> Engine:
    config = EngineConfig(
        async_scheduling=async_scheduling,
        device="cpu",
        attention_backend="triton",
        use_cuda_graph=True,
        block_size=16,
        num_blocks=num_blocks,
        max_batch_tokens=16_384,
        max_num_seqs=batch,
    )
    return Engine(HostOnlyModel(), config)


def timed(spent: list[float], function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return wrapper


def decode_steps(batch: int, context: int, steps: int, repeats: int, async_scheduling: bool) -> dict[str, float]:
    """Median host time per decode step and per phase, best of ``repeats`` runs of ``steps`` steps."""
    params = SamplingParams(max_new_tokens=steps * repeats + 8, ignore_eos=True)
    blocks_per_request = blocks_for(context + params.max_new_tokens, 16)  # no request is ever preempted
    engine = engine_for(batch, batch * blocks_per_request, async_scheduling)
    for i in range(batch):
        engine.add_request([3 + (7 * i + j) % 500 for j in range(context)], params)
    while engine.step().num_prefill_tokens:  # prefill everything
        pass
    phases: dict[str, list[float]] = {"plan": [], "runner": []}
    engine.scheduler.schedule = timed(phases["plan"], engine.scheduler.schedule)
    run = "launch" if async_scheduling else "execute"  # async: the token read comes later, in the commit's share
    setattr(engine.runner, run, timed(phases["runner"], getattr(engine.runner, run)))
    best: dict[str, float] = {}
    for _ in range(repeats):
        for spent in phases.values():
            spent.clear()
        times = []
        with frozen_heap():
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
        step = statistics.median(times)
        if step < best.get("step", float("inf")):
            best = {"step": step, **{name: statistics.median(spent) for name, spent in phases.items()}}
    best["commit"] = best["step"] - best["plan"] - best["runner"]
    return best


def served(frozen: bool, num_requests: int) -> dict[str, float]:
    """The nano-vllm workload end to end on the no-op model, reports kept; seconds and full-collection time."""
    rng = np.random.default_rng(0)
    prompt_lens, output_lens = rng.integers(100, 1025, num_requests), rng.integers(100, 1025, num_requests)
    prompts = [rng.integers(3, 1000, n).tolist() for n in prompt_lens]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in output_lens]
    engine = engine_for(min(num_requests, 256), num_blocks=num_requests * 130)  # 2,048 tokens each, and spare
    engine.generate(prompts[:4], [SamplingParams(max_new_tokens=4, ignore_eos=True)] * 4)  # warm-up
    reports: list[Any] = []
    engine.step_listeners.append(reports.append)
    full = {"s": 0.0, "count": 0, "start": 0.0}

    def watch(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                full["start"] = time.perf_counter()
            else:
                full["s"] += time.perf_counter() - full["start"]
                full["count"] += 1

    with frozen_heap() if frozen else nullcontext():
        gc.callbacks.append(watch)
        try:
            start = time.perf_counter()
            engine.generate(prompts, params)
            seconds = time.perf_counter() - start
        finally:
            gc.callbacks.remove(watch)
    tokens = int(output_lens.sum())
    return {"s": seconds, "tokens": tokens, "steps": len(reports), "full_s": full["s"], "full": full["count"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per repeat (default 40)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per shape, best one kept (default 5)")
    parser.add_argument("--quick", action="store_true", help="batch 8 at 100 tokens only, 16 requests served")
    args = parser.parse_args()
    shapes = [(8, 100)] if args.quick else [(batch, context) for batch in (8, 64, 256) for context in (100, 800)]
    torch.set_num_threads(1)
    console = Console(width=120)

    table = Table(title="host time per decode step", caption="forward pass replaced by nothing; Triton path, graphs on")
    columns = (
        "batch",
        "context",
        "ms/step",
        "us/request",
        "plan ms",
        "runner ms",
        "commit + report ms",
        "async ms/step",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for batch, context in shapes:
        row = decode_steps(batch, context, args.steps, args.repeats, async_scheduling=False)
        ahead = decode_steps(batch, context, args.steps, args.repeats, async_scheduling=True)
        table.add_row(
            str(batch),
            str(context),
            f"{row['step'] * 1e3:.2f}",
            f"{row['step'] * 1e6 / batch:.1f}",
            *(f"{row[name] * 1e3:.2f}" for name in ("plan", "runner", "commit")),
            f"{ahead['step'] * 1e3:.2f}",
        )
    console.print(table)

    num_requests = 16 if args.quick else 256
    table = Table(title=f"nano-vllm workload, {num_requests} requests", caption="no-op model, step reports kept")
    for column in ("heap", "host s", "steps", "output tokens/s", "full collections", "in them (s)"):
        table.add_column(column, justify="right")
    for frozen in (False, True):
        run = served(frozen, num_requests)
        table.add_row(
            "frozen" if frozen else "as is",
            f"{run['s']:.2f}",
            str(run["steps"]),
            f"{run['tokens'] / run['s']:,.0f}",
            str(run["full"]),
            f"{run['full_s']:.2f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
