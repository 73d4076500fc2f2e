"""Greedy parity: the paged engine produces exactly what ``model.generate`` produces for each prompt alone.

float32 on the CPU, random-weight Llama, Qwen2, Qwen3 and Mistral (with a sliding window) models; prompts
of 1 to 300 tokens that cross block boundaries; block sizes 1, 7 and 16; both policies; chunked prefill
on and off; EOS and stop-token stopping; a cache small enough to force preemptions. Each reference
generation runs once per model and is reused by every configuration. Threads: torch runs on 1 thread.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

import pytest
import torch

from labkit import Engine, EngineConfig, SamplingParams
from labkit.core.blocks import blocks_for

ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": 48}}
PROMPT_LENGTHS = (1, 6, 16, 17, 40, 129, 300)
CROWD_LENGTHS = (45, 50, 55, 60, 48, 52)  # similar requests that all start together, then outgrow the cache
MAX_NEW_TOKENS = 12


class Case(NamedTuple):
    model: Any
    prompts: list[list[int]]
    references: list[list[int]]
    crowd: list[list[int]]
    crowd_references: list[list[int]]


@pytest.fixture(scope="module", params=list(ARCHS))
def case(request, tiny_model) -> Case:
    """A model, prompts, and each prompt's greedy continuation by ``model.generate`` (EOS off)."""
    model = tiny_model(request.param, **ARCHS[request.param])
    rng = random.Random(1)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    crowd = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in CROWD_LENGTHS]
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    references = []
    for prompt in prompts + crowd:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        references.append(out[0, len(prompt) :].tolist())
    model.generation_config.eos_token_id = eos
    return Case(model, prompts, references[: len(prompts)], crowd, references[len(prompts) :])


def run(model, prompts, config, params):
    """Generate with a fresh engine; return outputs and the number of preemptions, checking no block leaked."""
    engine = Engine(model, config)
    preemptions = []
    engine.step_listeners.append(lambda report: preemptions.extend(report.preempted))
    outputs = engine.generate(prompts, params)
    assert engine.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished()
    return outputs, len(preemptions)


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("chunked_prefill", [True, False])
def test_greedy_matches_generate(case, block_size, policy, chunked_prefill):
    model, prompts, references = case.model, case.prompts, case.references
    # A small token budget makes continuous batching split the long prompts into chunks.
    budget = 64 if policy == "continuous" and chunked_prefill else 512
    config = EngineConfig(
        block_size=block_size,
        num_blocks=1200 // block_size,
        max_batch_tokens=budget,
        max_num_seqs=8,
        policy=policy,
        chunked_prefill=chunked_prefill,
    )
    outputs, _ = run(model, prompts, config, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    assert [o.output_token_ids for o in outputs] == references
    assert all(o.finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("chunked_prefill", [True, False])
@pytest.mark.parametrize("block_size", [1, 7])
def test_greedy_matches_generate_through_preemptions(case, chunked_prefill, block_size):
    # Less room than the prompts alone need: running requests must evict each other to grow.
    num_blocks = int(0.9 * sum(blocks_for(n, block_size) for n in CROWD_LENGTHS))
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_batch_tokens=128 if chunked_prefill else 512,
        max_num_seqs=8,
        chunked_prefill=chunked_prefill,
    )
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs, preemptions = run(case.model, case.crowd, config, params)
    assert preemptions > 0
    assert [o.output_token_ids for o in outputs] == case.crowd_references


def truncate_at(tokens: list[int], stop: int) -> list[int]:
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_eos_from_the_model_stops_like_generate(case, policy):
    model, prompts, references = case.model, case.prompts, case.references
    eos = references[-1][4]  # a token the longest prompt generates mid-way: at least one request stops early
    expected = [truncate_at(r, eos) for r in references]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos
    try:
        config = EngineConfig(block_size=16, num_blocks=80, policy=policy)
        outputs, _ = run(model, prompts, config, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    finally:
        model.generation_config.eos_token_id = saved
    assert [o.output_token_ids for o in outputs] == expected
    assert outputs[-1].finish_reason == "stop"
    # ignore_eos generates past it.
    with_eos_ignored, _ = run(model, prompts, config, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    assert [o.output_token_ids for o in with_eos_ignored] == references


def test_stop_token_ids_stop_each_request(case):
    model, prompts, references = case.model, case.prompts, case.references
    stops = [r[3] for r in references]  # request i stops at its own 4th token (or earlier)
    params = [SamplingParams(max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[s], ignore_eos=True) for s in stops]
    outputs, _ = run(model, prompts, EngineConfig(block_size=16, num_blocks=80), params)
    assert [o.output_token_ids for o in outputs] == [truncate_at(r, s) for r, s in zip(references, stops, strict=True)]
    assert all(o.finish_reason == "stop" for o in outputs)
