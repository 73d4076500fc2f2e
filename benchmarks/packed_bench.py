"""The model's linear layers on a CPU: nn.Linear against oneDNN-packed weights (runtime.packed), by rows per step.

Every linear layer of the random-weight tiny Llama (the engine benchmark's model) runs once in model
order on ``rows`` token rows, as in one step; the weights do not fit in the CPU's caches together, so
each step streams them like a real forward pass. One torch thread (``torch.set_num_threads(1)``);
times are the median of ``--repeats`` interleaved rounds of ``--steps`` steps each.
Run: ``python benchmarks/packed_bench.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial

import torch
from rich.console import Console
from rich.table import Table

from labkit.models.random import random_model
from labkit.runtime.packed import PACKED_MAX_ROWS, PackedLinears
from labkit.runtime.runner import device_name

ROWS = (1, 4, 8, 16, 32, 64, 128, 512)


def time_steps(step: Callable[[], None], steps: int) -> float:
    """Milliseconds per step."""
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps * 1e3


def run_layers(layers: list[torch.nn.Linear], inputs: list[torch.Tensor]) -> None:
    for layer, x in zip(layers, inputs, strict=True):
        layer(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the median is shown")
    args = parser.parse_args()

    torch.set_num_threads(1)
    model = random_model("llama", "tiny")
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    packed = PackedLinears(model)
    megabytes = sum(layer.weight.nbytes for layer in layers) / 2**20
    table = Table(
        title=f"{len(layers)} linear layers ({megabytes:.1f} MiB of float32 weights) per step,"
        f" 1 thread of {device_name(torch.device('cpu'))}; ms per step, median of {args.repeats}"
    )
    for column in ("rows", "nn.Linear", "packed", "speed-up", "packed path"):
        table.add_column(column, justify="right")
    with torch.inference_mode():
        for rows in ROWS:
            inputs = [torch.randn(1, rows, layer.in_features) for layer in layers]
            step = partial(run_layers, layers, inputs)

            times: dict[str, list[float]] = {"nn.Linear": [], "packed": []}
            for _ in range(args.repeats + 1):  # the first round warms up (oneDNN builds its kernels)
                for name, weights in (("nn.Linear", nullcontext), ("packed", packed.active)):
                    with weights():
                        times[name].append(time_steps(step, args.steps))
            plain, fast = (statistics.median(t[1:]) for t in times.values())
            path = "oneDNN" if rows <= PACKED_MAX_ROWS else "nn.Linear (above the cap)"
            table.add_row(str(rows), f"{plain:.2f}", f"{fast:.2f}", f"{plain / fast:.2f}x", path)
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
