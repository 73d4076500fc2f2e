"""What the bench checks before its first run, so a bad setting fails in seconds, not after minutes of work.

Three kinds of check, each raising ValueError (ImportError for a missing vLLM) with a message that
names the problem: can a mode run at all here (:func:`check_modes`: the model, the arrival rate, the
install); does every mode accept every request of the workload (:func:`check_workload`); can the
outputs be written (:func:`check_output_paths`). labkit's modes are asked by their own engine,
``Engine.add_request``, so the check follows the engine's rules wherever they change; the baselines
are checked for what each of them needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from labkit.core.engine import Engine
from labkit.serving.bench.loading import vocab_size
from labkit.serving.bench.modes import (
    MODES,
    BenchSetup,
    baseline_num_blocks,
    labkit_config,
    max_model_len,
    release_gpu_cache,
    vllm_cache_bytes,
    vllm_max_model_len,
    vllm_model_path,
    vllm_on_cpu,
)
from labkit.serving.workloads import WorkloadRequest

MODEL_MODES = ("hf-generate", "hf-continuous", "vllm")  # need a transformers model, not the simulated one
OFFLINE_MODES = ("vllm",)  # every request at t=0 only
VLLM_CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention takes only blocks of a multiple of 32 tokens


# ---------------------------------------------------------------------------------------------- can it run
def expand_modes(modes: Sequence[str], setup: BenchSetup, online: bool) -> list[str]:
    """The modes to run, in order: ``all`` becomes every mode this model, rate and install can run."""
    expanded: list[str] = []
    for mode in modes:
        if mode == "all":
            expanded += [m for m in MODES if m not in expanded and unavailable(m, setup, online) is None]
        elif mode not in expanded:
            expanded.append(mode)
    return expanded


def check_modes(modes: Sequence[str], setup: BenchSetup, online: bool) -> None:
    """Refuse, before anything runs, a mode that is unknown or cannot run with this model, rate or install."""
    if not modes:
        raise ValueError("no modes to run")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)} (or all)")
        reason = unavailable(mode, setup, online)
        if reason is not None:
            raise ValueError(f"mode {mode!r} cannot run: {reason}")


def unavailable(mode: str, setup: BenchSetup, online: bool) -> str | None:
    """Why ``mode`` cannot run with this model, rate and install; None when it can."""
    if mode in MODEL_MODES and setup.simulated:
        # vLLM loads a model from a directory, which a random-weight model has not: it needs a saved one.
        instead = "tiny-shakespeare" if mode == "vllm" else "random:tiny"
        return f"it runs a transformers model, and the simulated model is not one (try --model {instead})"
    if mode in OFFLINE_MODES and online:
        return "it serves offline only (every request at t=0); drop --rate or this mode"
    if mode == "vllm":
        from labkit.serving.baselines import import_vllm

        try:
            import_vllm()
            vllm_model_path(setup.model_name)
        except (ImportError, ValueError) as error:
            return str(error)
        block_size = setup.config.block_size
        if vllm_on_cpu() and block_size % VLLM_CPU_BLOCK_MULTIPLE:
            return f"vLLM's CPU attention needs --block-size a multiple of {VLLM_CPU_BLOCK_MULTIPLE}, not {block_size}"
    return None


# Latency metrics a mode does not measure: vLLM's outputs do not say when a request was first scheduled.
UNMEASURED = {"vllm": ("queue_time",)}


def check_targets(modes: Sequence[str], targets: Mapping[str, float] | None) -> None:
    """Refuse a latency target that a mode cannot measure: every one of its requests would count as a miss."""
    for mode in modes:
        for name in UNMEASURED.get(mode, ()):
            if targets and name in targets:
                raise ValueError(f"mode {mode!r} does not measure {name}, so a {name} target cannot be checked for it")


# ---------------------------------------------------------------------------------------------- will it serve it
AcceptFn = Callable[[Sequence[WorkloadRequest], BenchSetup], None]


def check_workload(modes: Sequence[str], workload: Sequence[WorkloadRequest], setup: BenchSetup) -> None:
    """Refuse a workload that any of ``modes`` would refuse or fail on part-way; modes without a check pass."""
    if not workload:
        raise ValueError("the workload is empty")
    for item in workload:
        if isinstance(item.prompt, str):
            raise TypeError("bench prompts must be token ids; convert text prompts with tokenize_workload")
    for mode in modes:
        accepts = ACCEPTS.get(mode)
        if accepts is not None:
            try:
                accepts(workload, setup)
            except ValueError as error:
                raise ValueError(f"mode {mode!r} cannot serve this workload: {error}") from None


def labkit_accepts(policy: str) -> AcceptFn:
    """A labkit mode's check: queue every request on an engine built as the mode builds it, then drop it.

    ``Engine.add_request`` is where the engine refuses a request (vocabulary, the model's length, the
    cache, the token budget), so this asks the engine itself. The throwaway engine skips packing the
    weights, which changes no rule.
    """

    def accepts(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> None:
        engine = Engine(setup.model, replace(labkit_config(setup, policy), pack_weights=False))
        try:
            for index, item in enumerate(workload):
                try:
                    engine.add_request(item.prompt, item.sampling_params(ignore_eos=setup.ignore_eos))
                except ValueError as error:
                    raise ValueError(f"request {index}: {error}") from None
        finally:
            del engine
            release_gpu_cache()

    return accepts


def hf_accepts(workload: Sequence[WorkloadRequest], setup: BenchSetup, cache_blocks: int | None = None) -> None:
    """What transformers needs: token ids in the vocabulary, and every request within the model's length.

    ``generate`` would run past the model's positions without a word (or fail there, for learned ones);
    labkit refuses such a request, so a comparison must too. With ``cache_blocks``, each request must
    also fit the whole cache, or transformers' continuous batching stops part-way.
    """
    vocab = vocab_size(setup.model)
    limit = max_model_len(setup.model)
    block_size = setup.config.block_size
    for index, item in enumerate(workload):
        outside = [t for t in item.prompt if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"request {index}: prompt token id {outside[0]} is outside the vocabulary [0, {vocab})")
        length = len(item.prompt) + item.max_new_tokens
        if length > limit:
            raise ValueError(
                f"request {index}: prompt ({len(item.prompt)} tokens) + max_new_tokens ({item.max_new_tokens})"
                f" exceeds the model's maximum length ({limit})"
            )
        if cache_blocks is not None and length - 1 > cache_blocks * block_size:
            raise ValueError(
                f"request {index}: prompt + max_new_tokens needs {length - 1} cache slots, but the cache"
                f" holds {cache_blocks * block_size} ({cache_blocks} blocks x {block_size})"
            )


def hf_continuous_accepts(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> None:
    """transformers' continuous batching: :func:`hf_accepts`, and every request within the cache it is given."""
    hf_accepts(workload, setup, cache_blocks=baseline_num_blocks(setup))


def vllm_accepts(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> None:
    """vLLM starts only if its KV cache holds one request of its ``max_model_len``: labkit's budget on a CPU."""
    hf_accepts(workload, setup)
    cfg = setup.config
    needed = vllm_max_model_len(workload, cfg.block_size, max_model_len(setup.model))
    cache_bytes = vllm_cache_bytes(setup)
    if cache_bytes is None:
        return
    from labkit.runtime.runner import kv_bytes_per_block

    capacity = cache_bytes // kv_bytes_per_block(setup.model, cfg.block_size) * cfg.block_size
    if needed > capacity:
        raise ValueError(
            f"vLLM needs room for one request of max_model_len {needed} tokens (the longest request, in whole"
            f" blocks of {cfg.block_size}), but labkit's KV-cache budget holds {capacity}; raise --num-blocks"
        )


ACCEPTS: dict[str, AcceptFn] = {
    "labkit-continuous": labkit_accepts("continuous"),
    "labkit-static": labkit_accepts("static"),
    "hf-generate": hf_accepts,
    "hf-continuous": hf_continuous_accepts,
    "vllm": vllm_accepts,
}


# ---------------------------------------------------------------------------------------------- can it write
def check_output_paths(paths: dict[str, Path | None]) -> None:
    """Refuse an output path (``{"--json": path, ...}``) that could not be written once the runs are done."""
    given = {option: path for option, path in paths.items() if path is not None}
    seen: dict[Path, str] = {}
    for option, path in given.items():
        resolved = path.resolve()
        if resolved in seen:
            raise ValueError(f"{seen[resolved]} and {option} name the same file, {path}")
        seen[resolved] = option
        parent = resolved.parent
        if path.is_dir():
            raise ValueError(f"{option} {path}: is a directory; give a file name")
        if not parent.is_dir():
            raise ValueError(f"{option} {path}: the folder {parent} does not exist")
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(f"{option} {path}: the file is not writable")
        if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{option} {path}: the folder {parent} is not writable")
