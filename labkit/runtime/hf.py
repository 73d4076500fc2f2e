"""``generate_batch``: transformers' batch-generation call, run on labkit's engine.

Code written for ``model.generate_batch(inputs=..., generation_config=...)`` runs on labkit by changing
that one line to ``labkit.generate_batch(model, inputs=..., generation_config=...)``: same inputs (lists
of token ids), same GenerationConfig fields, same result (a dict from "req_0", "req_1", ... to outputs
with ``.prompt_ids`` and ``.generated_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.request import SamplingParams

# Continuous-batching knobs that tutorials set on a GenerationConfig, and labkit's names for them.
GENERATION_CONFIG_KNOBS = {
    "num_blocks": "num_blocks",
    "block_size": "block_size",
    "max_batch_tokens": "max_batch_tokens",
}
# The same knobs on transformers' ContinuousBatchingConfig.
BATCHING_CONFIG_KNOBS = {
    "num_blocks": "num_blocks",
    "page_size": "block_size",
    "max_batch_tokens": "max_batch_tokens",
    "max_requests_per_batch": "max_num_seqs",
}


@dataclass
class GenerationResult:
    """One request's result, with the field names of transformers' GenerationOutput."""

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    finish_reason: str | None = None

    def is_finished(self) -> bool:
        return self.finish_reason is not None


def generate_batch(
    model: Any,
    inputs: Sequence[Sequence[int]],
    generation_config: Any = None,
    *,
    continuous_batching_config: Any = None,
    max_new_tokens: int | None = None,
    progress_bar: bool = False,
    **engine_options: Any,
) -> dict[str, GenerationResult]:
    """Generate for every prompt in ``inputs`` with labkit's engine; return {"req_i": result} in input order.

    Reads ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p`` and ``eos_token_id`` from
    ``generation_config`` (default: the model's), plus the batching knobs ``num_blocks``, ``block_size`` and
    ``max_batch_tokens`` when set on it or on ``continuous_batching_config``. ``engine_options`` are
    EngineConfig fields and win over both (e.g. ``policy="static"``, ``device="cpu"``).
    """
    if generation_config is None:
        generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        raise ValueError("no generation_config given and the model has none")
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list of token-id lists, got {type(inputs).__name__}")
    if not inputs:
        return {}
    if (getattr(generation_config, "num_return_sequences", None) or 1) != 1:
        raise ValueError("num_return_sequences > 1 is not supported")

    options = _knobs(generation_config, GENERATION_CONFIG_KNOBS)
    if continuous_batching_config is not None:
        options.update(_knobs(continuous_batching_config, BATCHING_CONFIG_KNOBS))
    options.update(engine_options)
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown engine options {unknown}; EngineConfig fields are {sorted(known)}")

    params = _sampling_params(generation_config, max_new_tokens)
    engine = Engine(model, EngineConfig(**options))
    outputs = engine.generate(list(inputs), params, progress=progress_bar)
    return {
        f"req_{i}": GenerationResult(f"req_{i}", out.prompt_token_ids, out.output_token_ids, out.finish_reason)
        for i, out in enumerate(outputs)
    }


def _knobs(config: Any, names: dict[str, str]) -> dict[str, Any]:
    values = {ours: getattr(config, theirs, None) for theirs, ours in names.items()}
    return {name: value for name, value in values.items() if value is not None}


def _sampling_params(config: Any, max_new_tokens: int | None) -> SamplingParams:
    """SamplingParams from a GenerationConfig; its eos_token_id (if set) replaces the model's EOS ids."""
    if max_new_tokens is None:
        max_new_tokens = config.max_new_tokens
    if max_new_tokens is None:
        raise ValueError("set max_new_tokens (on the generation config or as an argument)")
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if config.do_sample:
        sampling["temperature"] = 1.0 if config.temperature is None else config.temperature
        sampling["top_k"] = config.top_k or 0
        sampling["top_p"] = 1.0 if config.top_p is None else config.top_p
    eos = config.eos_token_id
    if eos is not None:
        sampling["stop_token_ids"] = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        sampling["ignore_eos"] = True  # the model's own EOS ids are replaced by the ones above
    return SamplingParams(**sampling)
