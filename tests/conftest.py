"""Shared fixtures. Tests run offline; torch tests build tiny random-weight models on one thread."""

from __future__ import annotations

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
