"""What labkit is measured against: transformers' own ways of running many requests.

* :func:`padded_generate` - the classic static batch: ``model.generate`` on groups of prompts,
  left-padded to the longest, every row decoding until the group's longest request is done.
* :class:`TransformersContinuous` (and the one-shot :func:`transformers_continuous`) - transformers'
  continuous-batching manager (the engine behind ``model.generate_batch``), with each request's own
  ``max_new_tokens``. The manager starts once, so timing a run leaves out its setup and its shutdown.

All run greedy with EOS off and return each request's generated tokens, cut to what it asked for,
so benchmarks count the same useful tokens for every method.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig


def padded_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    batch_size: int = 8,
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Greedy ``model.generate`` on batches of ``batch_size`` prompts in arrival order, EOS off.

    A batch decodes ``max(max_new_tokens)`` of its members; each request keeps only its own share.
    """
    _check_workload(prompts, max_new_tokens)
    device = model.device
    outputs: list[list[int]] = []
    for first in range(0, len(prompts), batch_size):
        group = [list(p) for p in prompts[first : first + batch_size]]
        wanted = list(max_new_tokens[first : first + batch_size])
        longest = max(map(len, group))
        input_ids = torch.tensor([[pad_token_id] * (longest - len(p)) + p for p in group], device=device)
        attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group], device=device)
        config = GenerationConfig(do_sample=False, max_new_tokens=max(wanted), pad_token_id=pad_token_id)
        with torch.inference_mode(), _eos_off(model):
            generated = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
        for row, n in zip(generated[:, longest:].tolist(), wanted, strict=True):
            outputs.append(row[:n])
    return outputs


class TransformersContinuous:
    """transformers' continuous-batching manager, started once and reused, so a run times only its requests.

    Use as a context manager. ``block_size``, ``num_blocks``, ``max_batch_tokens`` and ``max_num_seqs`` mean
    what they mean for labkit's EngineConfig (transformers calls them page_size, num_blocks,
    max_batch_tokens, max_requests_per_batch). The model's attention implementation is restored on exit.
    """

    def __init__(
        self,
        model: Any,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_tokens: int = 512,
        max_num_seqs: int = 64,
    ) -> None:
        self.model = model
        self.generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        self.batching = ContinuousBatchingConfig(
            page_size=block_size,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_num_seqs,
            allow_block_sharing=False,  # labkit has no prefix caching either
        )
        self._attention = model.config._attn_implementation
        self._context: Any = None
        self._manager: Any = None

    def __enter__(self) -> TransformersContinuous:
        self._context = self.model.continuous_batching_context_manager(
            generation_config=copy.deepcopy(self.generation), continuous_batching_config=self.batching, block=True
        )
        self._manager = self._context.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self._context.__exit__(*exc_info)
        finally:
            self.model.config._attn_implementation = self._attention
            self._context = self._manager = None

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> list[list[int]]:
        """Greedy, EOS off, one ``max_new_tokens`` per request; the generated tokens in input order."""
        _check_workload(prompts, max_new_tokens)
        if self._manager is None:
            raise RuntimeError("use TransformersContinuous as a context manager")
        manager = self._manager
        ids = [
            manager.add_request(list(p), max_new_tokens=n, eos_token_id=-1)
            for p, n in zip(prompts, max_new_tokens, strict=True)
        ]
        results: dict[str, list[int]] = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped before finishing all requests")
            if result.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed on {result.request_id}: {result.error}")
            if result.is_finished():
                results[result.request_id] = list(result.generated_tokens)
        return [results[i] for i in ids]


def transformers_continuous(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], **batching: Any
) -> list[list[int]]:
    """One-shot :class:`TransformersContinuous`: start the manager, generate, stop it."""
    with TransformersContinuous(model, **batching) as runner:
        return runner.generate(prompts, max_new_tokens)


@contextmanager
def _eos_off(model: Any) -> Iterator[None]:
    """generate() fills an unset eos_token_id from the model's generation config: unset it there too, for a while."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = saved


def _check_workload(prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> None:
    if len(prompts) != len(max_new_tokens):
        raise ValueError(f"got {len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
    if not prompts:
        raise ValueError("no prompts")
