"""A simulated model: the real scheduler and allocator, driven without torch at any scale.

The simulated model produces deterministic tokens and charges each step a modelled time
``base + per_token * tokens computed + per_kv_token * KV tokens read``. A step costs a fixed
overhead (reading all weights once, launching kernels), then work that grows with the batch, then
attention that grows with the context. That is why batching pays: the fixed part is shared.

A cost model may also charge the host's Python per step (``host_base + host_per_request * requests``:
plan the step, build its inputs, commit it). Without async scheduling it adds to the device's time; with
it (``EngineConfig(async_scheduling=True)``) host and device overlap, and a step takes the longer of the two.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple

from labkit.core.blocks import BlockAllocator
from labkit.core.config import EngineConfig
from labkit.core.request import Request, as_int, as_seconds
from labkit.core.scheduler import SchedulerOutput


@dataclass(frozen=True)
class CostModel:
    """Modelled seconds for one step: ``base + per_token * tokens + per_kv_token * kv_tokens`` on the device,
    and ``host_base + host_per_request * requests`` of the engine's Python on the host (0 unless set)."""

    name: str
    base: float
    per_token: float
    per_kv_token: float
    host_base: float = 0.0
    host_per_request: float = 0.0

    def __post_init__(self) -> None:
        # Every field but the name is seconds added to the simulated clock: a negative or NaN one would run it
        # backwards or lose it (and the run's trace would be refused), and text would fail only at the first step.
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        for field in ("base", "per_token", "per_kv_token", "host_base", "host_per_request"):
            object.__setattr__(self, field, as_seconds(field, getattr(self, field)))  # frozen: only here normalized

    def step_time(self, num_tokens: int, num_kv_tokens: int) -> float:
        """The device's time for a step that computes ``num_tokens`` rows over ``num_kv_tokens`` keys."""
        return self.base + self.per_token * num_tokens + self.per_kv_token * num_kv_tokens

    def host_time(self, num_requests: int) -> float:
        """The host's time for a step of ``num_requests`` requests."""
        return self.host_base + self.host_per_request * num_requests


# Rough figures for a ~0.5B-parameter model. CPU: reading ~2 GB of float32 weights per step at ~20 GB/s,
# ~1 GFLOP per token at ~100 GFLOP/s. H200-class GPU in bfloat16: launch overhead dominates the base,
# ~1 GFLOP per token at a few hundred TFLOP/s, ~12 KB of KV per token read at ~4.8 TB/s.
# "h200-graphs": the same GPU with decode steps replayed as CUDA graphs, so the launch overhead is gone and the
# base is the weights' read (~1 GB at ~4.8 TB/s, with the kernels' tails); left is the engine's Python, as
# benchmarks/host_bench.py measures it on a 2-core server CPU (65 us a step and 5.1 us a request, graphs on).
COST_PRESETS: dict[str, CostModel] = {
    "cpu": CostModel("cpu", base=0.1, per_token=0.01, per_kv_token=1.2e-6),
    "h200": CostModel("h200", base=0.004, per_token=2.5e-6, per_kv_token=2.5e-9),
    "h200-graphs": CostModel(
        "h200-graphs", base=3e-4, per_token=2.5e-6, per_kv_token=2.5e-9, host_base=6.5e-5, host_per_request=5.1e-6
    ),
}


@dataclass(frozen=True)
class SimulatedModel:
    """Stands in for a language model. Tokens depend only on the request and position, never on the batch.

    Token 0 is padding and token 1 is EOS. With ``mean_output_len`` set, each request emits EOS after
    a long-tailed (geometric) number of tokens fixed by its prompt; otherwise only
    ``max_new_tokens`` stops it. ``cost`` is a preset name or a CostModel.
    """

    vocab_size: int = 1024
    max_model_len: int = 1 << 20
    mean_output_len: float | None = None
    seed: int = 0
    cost: str | CostModel = "cpu"
    default_num_blocks: int = 1024

    eos_token_id = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_model_len", "seed", "default_num_blocks"):  # numpy's too, stored as ints
            object.__setattr__(self, name, as_int(name, getattr(self, name)))
        if self.vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3 (pad, EOS and one real token), got {self.vocab_size}")
        if self.max_model_len < 1 or self.default_num_blocks < 1:
            raise ValueError("max_model_len and default_num_blocks must be >= 1")
        if isinstance(self.cost, str):
            if self.cost not in COST_PRESETS:
                raise ValueError(f"unknown cost preset {self.cost!r}; choose from {sorted(COST_PRESETS)}")
        elif not isinstance(self.cost, CostModel):
            raise TypeError(f"cost must be a preset name or a CostModel, got {type(self.cost).__name__}")
        if self.mean_output_len is not None:  # numpy's numbers too, stored as a float
            if isinstance(self.mean_output_len, bool) or not isinstance(self.mean_output_len, numbers.Real):
                raise TypeError(f"mean_output_len must be a number or None, got {type(self.mean_output_len).__name__}")
            if not 1 <= self.mean_output_len < math.inf:
                raise ValueError(f"mean_output_len must be a finite number >= 1, got {self.mean_output_len}")
            object.__setattr__(self, "mean_output_len", float(self.mean_output_len))

    @property
    def cost_model(self) -> CostModel:
        return COST_PRESETS[self.cost] if isinstance(self.cost, str) else self.cost

    def make_runner(self, config: EngineConfig) -> SimRunner:
        return SimRunner(self)

    def next_token(self, request: Request) -> int:
        """The token this model generates after ``request``'s current tokens."""
        prompt = request.prompt_token_ids
        h = _mix(self.seed, len(prompt), prompt[0], prompt[-1], request.num_tokens)
        # Geometric output length with the given mean: P(EOS at each token) = 1 / mean.
        mean = self.mean_output_len
        if mean is not None and h % 1_000_003 < 1_000_003 / mean:
            return self.eos_token_id
        return 2 + (h >> 32) % (self.vocab_size - 2)  # the high bits, independent of the EOS draw


class SimLaunch(NamedTuple):
    """A step the simulated device has run: its tokens, and the simulated time they were ready."""

    tokens: list[int]
    ready_at: float


class SimRunner:
    """Runs a step of a SimulatedModel: advances a simulated clock by the cost model's time."""

    def __init__(self, model: SimulatedModel) -> None:
        self.model = model
        self.cost = model.cost_model
        self.vocab_size = model.vocab_size
        self.max_model_len = model.max_model_len
        self.eos_token_ids = frozenset({model.eos_token_id})
        self.device_name = f"simulated ({self.cost.name})"
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def wait_until(self, t: float) -> None:
        """Idle until the clock reads ``t``: simulated time simply jumps there (it never runs backwards)."""
        self.now = max(self.now, t)

    def init_cache(self, block_size: int, num_blocks: int | None) -> int:
        return num_blocks or self.model.default_num_blocks

    def execute(self, output: SchedulerOutput, allocator: BlockAllocator) -> list[int]:
        """One step: the host plans and commits it, the device computes it, one after the other."""
        host, device = self._times(output)
        self.now += host + device
        return self._tokens(output)

    def launch(self, output: SchedulerOutput, allocator: BlockAllocator, previous: Any = None) -> SimLaunch:
        """Async scheduling: the host works on the next step while the device runs this one, so a step takes
        the longer of the two. Its tokens are known at once (they depend on positions, not on values)."""
        self.now += max(self._times(output))
        return SimLaunch(self._tokens(output), self.now)

    def collect(self, launched: SimLaunch) -> list[int]:
        return launched.tokens

    def ready_time(self, launched: SimLaunch) -> float:
        return launched.ready_at

    def _times(self, output: SchedulerOutput) -> tuple[float, float]:
        """(host, device) seconds of a step."""
        kv_tokens = 0
        for chunk in output.chunks:
            kv_tokens += chunk.start + chunk.num_tokens
        for chunk in output.padding:
            kv_tokens += chunk.start + chunk.num_tokens
        host = 0.0
        if self.cost.host_base or self.cost.host_per_request:
            host = self.cost.host_time(len({c.request.request_id for c in (*output.chunks, *output.padding)}))
        return host, self.cost.step_time(output.num_tokens, kv_tokens)

    def _tokens(self, output: SchedulerOutput) -> list[int]:
        next_token = self.model.next_token
        return [next_token(chunk.request) for chunk in output.chunks if chunk.samples]


def _mix(*values: int) -> int:
    """A small, fast, deterministic integer hash (splitmix64 steps)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h
