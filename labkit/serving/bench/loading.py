"""What the bench serves: the model a ``--model`` spec names, and workloads as the token ids every mode sees."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from labkit.core.config import EngineConfig
from labkit.core.sim import SimulatedModel
from labkit.serving.bench.modes import BenchSetup
from labkit.serving.workloads import WorkloadRequest


def load_model(spec: str, config: EngineConfig | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a spec: ``sim`` or ``sim:<cost preset>`` (simulated), ``random:<size>``
    (a random-weight Llama, token-id prompts), or any name :func:`labkit.models.load` takes (the bundled
    ``tiny-shakespeare``, ``smollm2-135m``, a model directory, a cached hub id; text prompts).

    Real models go on ``config.device`` in ``config.dtype`` (default: float32 on the CPU, bfloat16 on a GPU).
    """
    kind, _, arg = spec.partition(":")
    if kind == "sim":
        return SimulatedModel(cost=arg or "cpu"), None
    config = config or EngineConfig()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from labkit.runtime.runner import resolve_device, resolve_dtype

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype) or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if kind == "random":
        from labkit.models.random import random_model

        return random_model(size=arg or "tiny", dtype=dtype).to(device), None
    from labkit.models import load

    return load(spec, device=device, dtype=dtype)


def tokenize_workload(workload: Sequence[WorkloadRequest], tokenizer: Any) -> list[WorkloadRequest]:
    """The same workload with text prompts turned into token ids, so every mode sees identical tokens."""
    return [
        replace(r, prompt=tokenizer.encode(r.prompt, add_special_tokens=False)) if isinstance(r.prompt, str) else r
        for r in workload
    ]


def special_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Ids a random prompt must avoid: padding, BOS, EOS and whatever the tokenizer marks special."""
    if isinstance(model, SimulatedModel):
        return {0, model.eos_token_id}
    if tokenizer is not None:
        return set(tokenizer.all_special_ids)
    config = model.config
    return {i for i in (config.pad_token_id, config.bos_token_id, config.eos_token_id) if isinstance(i, int)}


def vocab_size(model: Any) -> int:
    if isinstance(model, SimulatedModel):
        return model.vocab_size
    return model.get_input_embeddings().num_embeddings


def device_name(setup: BenchSetup) -> str:
    if setup.simulated:
        return f"simulated ({setup.model.cost_model.name})"
    from labkit.runtime.runner import device_name as runner_device_name
    from labkit.runtime.runner import resolve_device

    return runner_device_name(resolve_device(setup.config.device))
