"""Throughput of labkit's engine against transformers, on one CPU thread, with a random-weight Llama.

Workload: 32 requests arriving together, prompt lengths uniform in 16..128; 28 want 16..64 new tokens
and 4 want 256 (in shuffled positions); greedy, EOS off. Methods:

* labkit continuous - the engine with continuous batching and chunked prefill, as configured by default (its
  linear layers oneDNN-packed if the runner measured that faster here: labkit.runtime.packed)
* labkit continuous, packed / nn.Linear - the same with packing forced on / off: what packing does on this CPU
* labkit static     - the same engine, static batches of 8 in arrival order (padded prompts, finished rows kept)
* HF generate       - transformers ``model.generate`` on left-padded batches of 8 in arrival order
* HF continuous     - transformers' continuous-batching manager, per-request max_new_tokens

Each method is set up (engine and KV cache, or transformers' manager and its thread), warmed up on a
small workload, then timed on the full one, from the first request submitted to the last token
received; runs are repeated round-robin and the best kept. Throughput is the tokens the requests asked
for, divided by wall time. Run: ``python benchmarks/engine_bench.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from rich.console import Console
from rich.table import Table

from labkit import Engine, EngineConfig, SamplingParams
from labkit.models.random import random_model
from labkit.runtime.runner import device_name
from labkit.serving.baselines import TransformersContinuous, padded_generate
from labkit.serving.metrics import frozen_heap

CACHE_TOKENS = 16384  # KV-cache slots for every method: room for the whole workload, no preemption
MAX_BATCH_TOKENS = 512
MAX_NUM_SEQS = 64
STATIC_BATCH = 8
MAX_PROMPT = 128

Workload = tuple[list[list[int]], list[int]]


def make_workload(seed: int, vocab_size: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(16, MAX_PROMPT))] for _ in range(32)]
    wanted = [rng.randint(16, 64) for _ in range(28)] + [256] * 4
    rng.shuffle(wanted)
    return prompts, wanted


Generate = Callable[[Sequence[list[int]], Sequence[int]], list[list[int]]]


@contextmanager
def labkit_session(
    model: torch.nn.Module, block_size: int, policy: str, pack_weights: bool | None = None
) -> Iterator[Generate]:
    static = policy == "static"
    config = EngineConfig(
        block_size=block_size,
        num_blocks=CACHE_TOKENS // block_size,
        # A static batch prefills its padded prompts in one step: 8 rows of up to 128 tokens.
        max_batch_tokens=STATIC_BATCH * MAX_PROMPT if static else MAX_BATCH_TOKENS,
        max_num_seqs=STATIC_BATCH if static else MAX_NUM_SEQS,
        policy=policy,
        device="cpu",
        pack_weights=pack_weights,
    )
    engine = Engine(model, config)

    def generate(prompts: Sequence[list[int]], wanted: Sequence[int]) -> list[list[int]]:
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
        return [o.output_token_ids for o in engine.generate(prompts, params)]

    yield generate


@contextmanager
def hf_generate_session(model: torch.nn.Module, block_size: int) -> Iterator[Generate]:
    """``generate`` keeps each batch's cache contiguous: it has no block size."""
    yield lambda prompts, wanted: padded_generate(model, prompts, wanted, batch_size=STATIC_BATCH)


@contextmanager
def hf_continuous_session(model: torch.nn.Module, block_size: int) -> Iterator[Generate]:
    with TransformersContinuous(
        model,
        block_size=block_size,
        num_blocks=CACHE_TOKENS // block_size,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
    ) as manager:
        yield manager.generate


# Each session sets its method up (engine, cache, background thread: not timed) and yields a generate call.
SESSIONS: dict[str, Callable[[torch.nn.Module, int], AbstractContextManager[Generate]]] = {
    "labkit continuous": lambda model, block_size: labkit_session(model, block_size, "continuous"),
    "labkit continuous, packed": lambda model, block_size: labkit_session(model, block_size, "continuous", True),
    "labkit continuous, nn.Linear": lambda model, block_size: labkit_session(model, block_size, "continuous", False),
    "labkit static": lambda model, block_size: labkit_session(model, block_size, "static"),
    "HF generate (padded, 8)": hf_generate_session,
    "HF continuous batching": hf_continuous_session,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method, interleaved; the best is kept")
    parser.add_argument(
        "--block-size", type=int, default=16, help="KV-cache block (page) size, labkit and transformers"
    )
    args = parser.parse_args()

    torch.set_num_threads(1)
    console = Console(width=130)
    model = random_model("llama", "tiny", seed=0, dtype=torch.float32)
    prompts, wanted = make_workload(args.seed, model.config.vocab_size)
    total = sum(wanted)
    console.print(
        f"torch {torch.__version__} on 1 thread of {device_name(torch.device('cpu'))} (torch.set_num_threads(1)),"
        " float32; random-weight Llama: hidden 256, 4 layers, 4 heads / 2 KV heads, vocab 1024;"
        f" block size {args.block_size}, {MAX_BATCH_TOKENS} tokens per step"
    )
    console.print(
        f"32 requests, prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, {total} new tokens wanted"
        f" (256-token requests at positions {[i for i, n in enumerate(wanted) if n == 256]}), greedy, EOS off;"
        f" best of {args.repeats} interleaved runs after a warm-up"
    )

    wall = dict.fromkeys(SESSIONS, float("inf"))
    cpu = dict.fromkeys(SESSIONS, float("inf"))
    outputs = {}
    for _ in range(args.repeats):
        for name, session in SESSIONS.items():
            with session(model, args.block_size) as generate:
                generate(prompts[:4], [4] * 4)  # warm-up
                with frozen_heap():
                    start_wall, start_cpu = time.perf_counter(), time.process_time()
                    outputs[name] = generate(prompts, wanted)
                wall[name] = min(wall[name], time.perf_counter() - start_wall)
                cpu[name] = min(cpu[name], time.process_time() - start_cpu)
            if [len(o) for o in outputs[name]] != wanted:
                raise RuntimeError(f"{name} did not generate the requested number of tokens")

    rate = {name: total / seconds for name, seconds in wall.items()}
    reference = outputs["labkit continuous"]
    table = Table(title="Generated tokens per second (wall clock; higher is better)")
    columns = ("method", "wall s", "CPU s", "tokens/s", "vs labkit static", "vs HF continuous", "same tokens")
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right")
    for name in SESSIONS:
        same = sum(a == b for a, b in zip(outputs[name], reference, strict=True))
        table.add_row(
            name,
            f"{wall[name]:.2f}",
            f"{cpu[name]:.2f}",
            f"{rate[name]:.0f}",
            f"{rate[name] / rate['labkit static']:.2f}x",
            f"{rate[name] / rate['HF continuous batching']:.2f}x",
            f"{same}/{len(reference)}",
        )
    checks = [
        ("labkit continuous / labkit static", "labkit continuous", "labkit static", 2.0, None),
        ("labkit continuous / HF continuous", "labkit continuous", "HF continuous batching", 1.5, None),
        ("labkit static / HF generate", "labkit static", "HF generate (padded, 8)", 0.7, 1.3),
    ]
    lines = []
    for label, numerator, denominator, low, high in checks:
        ratio = rate[numerator] / rate[denominator]
        met = ratio >= low and (high is None or ratio <= high)
        target = f">= {low}" if high is None else f"{low}..{high}"
        lines.append(f"{label}: {ratio:.2f} (target {target}: {'met' if met else 'NOT met'})")
    table.caption = "\n".join(lines)
    console.print(table)


if __name__ == "__main__":
    main()
