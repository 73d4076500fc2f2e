"""Shared fixtures and helpers. Tests run offline; torch tests build tiny random-weight models on one thread."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import pytest

from labkit import SimulatedModel
from labkit.core.sim import SimRunner

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without an NVIDIA GPU, Triton kernels run only through Triton's interpreter, which must be switched on before
# anything imports triton (torch and transformers may, while other tests are collected). Checked without torch.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# 2 layers, hidden 64, grouped-query attention (4 query heads share 2 KV heads): small enough that a
# parity test runs dozens of engine configurations in seconds, real enough to exercise every code path.
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., Any]:
    """``tiny_model(arch="llama", seed=0, **overrides)``: a fresh 2-layer random model (torch pinned to 1 thread)."""
    import torch

    from labkit.models.random import random_model

    torch.set_num_threads(1)

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> Any:
        return random_model(arch, "tiny", seed=seed, **{**TINY_SHAPE, **overrides})

    return make


@pytest.fixture(scope="session")
def greedy_reference() -> Callable[[Any, list[int], int], list[int]]:
    """``greedy_reference(model, prompt, max_new_tokens)``: transformers' own greedy tokens, EOS ignored."""
    import torch

    def generate(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None
        )
        return out[0, len(prompt) :].tolist()

    return generate


class Boom(Exception):
    """The injected failure."""


def engine_state(engine: Any) -> tuple:
    """Everything a step may change: the scheduler, the allocator (its prefix cache too) and every request."""
    scheduler, allocator = engine.scheduler, engine.allocator
    requests = [
        (
            r.request_id,
            r.state,
            r.num_computed_tokens,
            list(r.output_token_ids),
            r.finish_reason,
            r.metrics.num_preemptions,
            r.metrics.first_scheduled_time,
            r.metrics.first_token_time,
            list(r.metrics.token_times),
            r.metrics.finish_time,
        )
        for r in engine.requests.values()
    ]
    cache = allocator.prefix_cache
    prefix = (
        None
        if cache is None
        else (
            dict(cache.index),
            dict(cache.digest_of),
            list(cache.reusable),  # in LRU order
            list(cache.evicted),  # oldest first
            dict(allocator.num_indexed),
            dataclasses.astuple(allocator.prefix_stats),
            [r.num_cached_tokens for r in engine.requests.values()],
        )
    )
    return (
        scheduler.step_index,
        [r.request_id for r in scheduler.waiting],
        [r.request_id for r in scheduler.running],
        sorted(scheduler.requests),
        list(allocator.free_blocks),
        {rid: list(table) for rid, table in allocator.block_tables.items()},
        dict(allocator.num_slots),
        list(allocator.ref_counts),
        list(allocator.events),
        allocator.step,
        requests,
        [r.request_id for r in engine._aborted],
        prefix,
    )


class ShadowRunner(SimRunner):
    """The simulated model with a shadow KV cache: each slot holds the token prefix whose keys it stores.

    A SimulatedModel's tokens never depend on the cache, so a block handed to the wrong request, or a
    cached block served after it was overwritten, would go unnoticed. This runner writes each computed
    position's prefix into the slot the block table maps it to, and then checks that every chunk of the
    step reads exactly its own prefix at every position, through its block table, as attention would.
    """

    def __init__(self, model: SimulatedModel) -> None:
        super().__init__(model)
        self.slots: dict[int, tuple[int, ...]] = {}

    def execute(self, output: Any, allocator: Any) -> list[int]:
        prefixes = {}
        for chunk in output.chunks:  # static batches' padding rows store nothing a request reads
            request, end = chunk.request, chunk.start + chunk.num_tokens
            tokens = prefixes[request.request_id] = tuple(request.token_at(i) for i in range(end))
            for position, slot in enumerate(allocator.slot_mapping(request.request_id, chunk.start, end), chunk.start):
                self.slots[slot] = tokens[: position + 1]
        for chunk in output.chunks:
            request_id, tokens = chunk.request.request_id, prefixes[chunk.request.request_id]
            for position, slot in enumerate(allocator.slot_mapping(request_id, 0, len(tokens))):
                assert self.slots.get(slot) == tokens[: position + 1], (
                    f"step {output.step}: request {request_id} reads position {position} from slot {slot}, which holds"
                    f" another prefix's keys and values"
                )
        return super().execute(output, allocator)


@dataclasses.dataclass(frozen=True)
class ShadowedModel(SimulatedModel):
    """A SimulatedModel whose engines check, every step, that each request reads its own keys and values."""

    def make_runner(self, config: Any) -> ShadowRunner:
        return ShadowRunner(self)
