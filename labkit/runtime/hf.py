"""``generate_batch``: transformers' batch-generation call, run on labkit's engine.

Code written for ``model.generate_batch(inputs=..., generation_config=...)`` runs on labkit by changing
that one line to ``labkit.generate_batch(model, inputs=..., generation_config=...)``: same inputs (lists
of token ids), same GenerationConfig fields, same result (a dict from "req_0", "req_1", ... to outputs
with ``.prompt_ids`` and ``.generated_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.request import SEED_RANGE, SamplingParams, as_int

# Continuous-batching knobs that tutorials set on a GenerationConfig, and labkit's names for them.
GENERATION_CONFIG_KNOBS = {
    "num_blocks": "num_blocks",
    "block_size": "block_size",
    "max_batch_tokens": "max_batch_tokens",
}
# The same knobs on transformers' ContinuousBatchingConfig (its block size is page_size in recent releases,
# block_size in 5.17 and older).
BATCHING_CONFIG_KNOBS = {
    "num_blocks": "num_blocks",
    "page_size": "block_size",
    "block_size": "block_size",
    "max_batch_tokens": "max_batch_tokens",
    "max_requests_per_batch": "max_num_seqs",
}
# GenerationConfig settings that change which tokens come out and that labkit does not implement, each with
# the value that switches it off. A setting left unset (None) or at that value is fine; any other is refused,
# so code written for transformers never gets different tokens without being told.
UNSUPPORTED_SETTINGS = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": 0.0,  # contrastive search runs only with a penalty_alpha above 0
    "dola_layers": None,
    "diversity_penalty": 0.0,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": 0,
    "max_time": None,
    "stop_strings": None,
    "min_p": 0.0,  # min_p * the top probability: 0 keeps every token
    "top_h": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "constraints": None,
    "sequence_bias": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "guidance_scale": 1.0,
    "watermarking_config": None,
    "token_healing": False,
    "prompt_lookup_num_tokens": None,
    "assistant_early_exit": None,
}
# What transformers samples with when do_sample is set and these are not.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass
class GenerationResult:
    """One request's result, with the field names of transformers' GenerationOutput."""

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    finish_reason: str | None = None
    timestamps: list[float] | None = None  # when each token was ready (time.perf_counter), with record_timestamps

    def is_finished(self) -> bool:
        return self.finish_reason is not None


def generate_batch(
    model: Any,
    inputs: Sequence[Sequence[int]],
    generation_config: Any = None,
    continuous_batching_config: Any = None,
    record_timestamps: bool = False,
    progress_bar: bool = False,
    persistent_manager: bool = False,
    warmup: bool = True,
    *,
    max_new_tokens: int | None = None,
    **engine_options: Any,
) -> dict[str, GenerationResult]:
    """Generate for every prompt in ``inputs`` with labkit's engine; return {"req_i": result} in input order.

    transformers' own arguments, in its order, mean what they mean there: ``record_timestamps`` fills each result's
    ``timestamps``; ``persistent_manager`` and ``warmup`` are accepted and change nothing (each call builds its
    engine, which captures its CUDA graphs as it starts).

    Reads ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p`` and ``eos_token_id`` from
    ``generation_config`` (a transformers GenerationConfig; default: the model's), plus the batching knobs
    ``num_blocks``, ``block_size`` and ``max_batch_tokens`` when set on it or on ``continuous_batching_config``.
    Sampling is reproducible as in transformers: ``continuous_batching_config.seed``, or else
    ``torch.manual_seed``, fixes the tokens.
    As in transformers, ``do_sample`` unset or False is greedy whatever the temperature. A setting labkit does
    not implement (``num_beams``, ``repetition_penalty``, ``min_new_tokens``, ...: UNSUPPORTED_SETTINGS) is
    refused with a ValueError unless it is left at the value that switches it off. ``engine_options`` are
    EngineConfig fields and win over the knobs (e.g. ``policy="static"``, ``device="cpu"``).
    """
    if generation_config is None:
        generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        raise ValueError("no generation_config given and the model has none")
    _check_generation_config(generation_config)
    if isinstance(continuous_batching_config, Mapping):
        raise TypeError("continuous_batching_config must be a transformers ContinuousBatchingConfig, got a dict")
    if not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list of token-id lists, got {type(inputs).__name__}")
    if not inputs:
        return {}

    options = _knobs(generation_config, GENERATION_CONFIG_KNOBS)
    if continuous_batching_config is not None:
        options.update(_knobs(continuous_batching_config, BATCHING_CONFIG_KNOBS))
    options.update(engine_options)
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown engine options {unknown}; EngineConfig fields are {sorted(known)}")

    params = _sampling_params(generation_config, max_new_tokens)
    if not params.greedy:  # request i draws with seed + i: reproducible, and the same alone or in any batch
        seed = _seed(continuous_batching_config)
        params = [replace(params, seed=(seed + i) % SEED_RANGE) for i in range(len(inputs))]
    engine = Engine(model, EngineConfig(**options))
    outputs = engine.generate(list(inputs), params, progress=progress_bar)
    return {
        f"req_{i}": GenerationResult(
            f"req_{i}",
            out.prompt_token_ids,
            out.output_token_ids,
            out.finish_reason,
            list(out.metrics.token_times) if record_timestamps else None,
        )
        for i, out in enumerate(outputs)
    }


def _seed(continuous_batching_config: Any) -> int:
    """Request 0's seed: ``continuous_batching_config.seed``, checked as SamplingParams checks a seed, so that an
    error names the value passed, not the seed + i of a later request; else, as in transformers, one that
    ``torch.manual_seed`` decides."""
    seed = getattr(continuous_batching_config, "seed", None)
    if seed is None:
        import torch  # here: importing labkit imports no torch

        return int(torch.randint(0, 2**62, ()))
    seed = as_int("continuous_batching_config.seed", seed)
    if not 0 <= seed < SEED_RANGE:
        raise ValueError(f"continuous_batching_config.seed must be in [0, 2**64) (or None), got {seed}")
    return seed


def _check_generation_config(config: Any) -> None:
    """TypeError for anything but a GenerationConfig; ValueError naming each setting labkit would ignore."""
    from transformers import GenerationConfig

    if not isinstance(config, GenerationConfig):
        raise TypeError(
            f"generation_config must be a transformers GenerationConfig, got {type(config).__name__}"
            " (for a dict d, pass GenerationConfig(**d))"
        )
    unsupported = [
        f"{name}={value!r} (off: {off!r})"
        for name, off in UNSUPPORTED_SETTINGS.items()
        if (value := getattr(config, name, None)) is not None and value != off
    ]
    if unsupported:
        raise ValueError(
            f"generation_config sets {', '.join(unsupported)}, which labkit's engine does not implement;"
            " leave them unset or switched off, or use model.generate"
        )


def _knobs(config: Any, names: dict[str, str]) -> dict[str, Any]:
    """labkit's name -> value of each knob set on ``config`` (of two names for one knob, the first one set)."""
    options: dict[str, Any] = {}
    for theirs, ours in names.items():
        value = getattr(config, theirs, None)
        if value is not None:
            options.setdefault(ours, value)
    return options


def _sampling_params(config: Any, max_new_tokens: int | None) -> SamplingParams:
    """SamplingParams from a GenerationConfig; its eos_token_id (if set) replaces the model's EOS ids."""
    if max_new_tokens is None:
        max_new_tokens = config.max_new_tokens
    if max_new_tokens is None:
        raise ValueError("set max_new_tokens (on the generation config or as an argument)")
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if config.do_sample:
        for name, default in SAMPLING_DEFAULTS.items():
            value = getattr(config, name)
            sampling[name] = default if value is None else value
    eos = config.eos_token_id
    if eos is not None:
        # A negative id (transformers' eos_token_id=-1) matches no token: nothing stops the request early.
        ids = eos if isinstance(eos, (list, tuple)) else (eos,)
        sampling["stop_token_ids"] = tuple(i for i in ids if i >= 0)
        sampling["ignore_eos"] = True  # the model's own EOS ids are replaced by the ones above
    return SamplingParams(**sampling)
