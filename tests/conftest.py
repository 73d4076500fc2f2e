"""Shared fixtures and helpers. Tests run offline; torch tests build tiny random-weight models on one thread."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import pytest

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
        ids = torch.tensor([prompt])
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
