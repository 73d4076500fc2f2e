"""Greedy parity with prefix caching on: shared blocks hold exactly the keys and values a request would compute.

float32 on the CPU, a random-weight Llama and Qwen3. Prompts share prefixes in every way that matters: an
exact multiple of the block size, a prompt identical to an earlier one, one that is a prefix of an earlier
one, longer and shorter extensions, a multi-turn chat; under every scheduling policy, with a cache big
enough to keep everything and one so small that requests are preempted and cached blocks evicted.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from labkit import Engine, EngineConfig, SamplingParams

BLOCK = 8
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tiny_model):
    return tiny_model(request.param)


def reference(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
    finally:
        model.generation_config.eos_token_id = eos
    return out[0, len(prompt) :].tolist()


def waves(vocab_size: int) -> list[list[list[int]]]:
    """Prompts in two waves: the second arrives once the first has finished, so it can hit its blocks."""
    rng = random.Random(3)
    base = [rng.randrange(3, vocab_size) for _ in range(4 * BLOCK)]  # exactly 4 blocks
    other = [rng.randrange(3, vocab_size) for _ in range(3 * BLOCK + 5)]
    first = [base, [*base[: 2 * BLOCK + 3], 7, 8, 9], other]
    second = [
        base,  # identical to an earlier prompt, an exact multiple of the block size
        base[: 3 * BLOCK],  # a prefix of an earlier prompt, itself a multiple of the block
        base[: 2 * BLOCK + 5],  # a prefix ending mid-block
        base + [rng.randrange(3, vocab_size) for _ in range(11)],  # an extension
        base[:BLOCK] + other[BLOCK:],  # shares only the first block
        [*other, 5, 6],
        base[:5],  # shorter than one block
    ]
    return [first, second]


def serve_waves(model, config: EngineConfig) -> tuple[Engine, list, list]:
    """Both waves through one engine, one after the other; the engine, its outputs and its step reports."""
    engine = Engine(model, config)
    reports: list = []
    engine.step_listeners.append(reports.append)
    outputs = []
    for number, wave in enumerate(waves(model.config.vocab_size)):
        params = [
            SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, priority=(i + number) % 3)
            for i in range(len(wave))
        ]
        outputs += engine.generate(wave, params)
    assert [o.output_token_ids for o in outputs] == [reference(model, o.prompt_token_ids) for o in outputs]
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert engine.num_free_blocks == engine.num_blocks
    return engine, outputs, reports


@pytest.mark.parametrize("scheduling", ["fcfs", "priority", "shortest-first"])
@pytest.mark.parametrize("num_blocks", [128, 12])
def test_greedy_outputs_equal_generate_with_prefix_caching(model, scheduling, num_blocks):
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=num_blocks,
        max_batch_tokens=48,
        max_num_seqs=4,
        enable_prefix_caching=True,
        scheduling=scheduling,
    )
    _, _, reports = serve_waves(model, config)
    kinds = {e.kind for r in reports for e in r.block_events}
    assert "hit" in kinds
    if num_blocks == 12:  # 96 slots for prompts of up to 43 tokens: requests are preempted, blocks evicted
        assert any(r.preempted for r in reports) and "evict" in kinds


def test_the_gpu_path_reads_shared_blocks_as_exactly(tiny_model):
    """The Triton kernels and decode graphs (Triton's interpreter on a CPU) on prefix-cached prompts: a request
    that starts from cached blocks attends to them from where they lie, preempted and evicted as above."""
    cuda = torch.cuda.is_available()
    if not cuda:
        pytest.importorskip("triton")
        from labkit.runtime.runner import interpreter_runs_kernels

        if os.environ.get("TRITON_INTERPRET") != "1" or not interpreter_runs_kernels():
            pytest.skip("without CUDA this needs Triton's interpreter (TRITON_INTERPRET=1, triton>=3.7)")
    model = tiny_model("qwen3").to("cuda" if cuda else "cpu")
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=12,
        max_batch_tokens=48,
        max_num_seqs=4,
        enable_prefix_caching=True,
        scheduling="priority",
        device="cuda" if cuda else "cpu",
        dtype="float32",
        attention_backend="triton",
        use_cuda_graph=True,
    )
    engine, _, reports = serve_waves(model, config)
    assert engine.runner.graphs.num_replays > 0 and any(r.preempted for r in reports)


def test_a_multi_turn_chat_equals_generate_turn_by_turn(model):
    engine = Engine(model, EngineConfig(block_size=BLOCK, num_blocks=64, enable_prefix_caching=True))
    rng = random.Random(5)
    history: list[int] = [rng.randrange(3, model.config.vocab_size) for _ in range(13)]
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    previous = None  # the previous turn's prompt length: its prompt and all but its last answer token are cached
    for _ in range(3):
        (out,) = engine.generate([history], params)
        assert out.output_token_ids == reference(model, history)
        if previous is None:
            assert out.num_cached_tokens == 0
        else:
            full = min((previous + MAX_NEW_TOKENS - 1) // BLOCK, (len(history) - 1) // BLOCK)
            assert out.num_cached_tokens == full * BLOCK > 0
        previous = len(history)
        history = history + out.output_token_ids + [rng.randrange(3, model.config.vocab_size) for _ in range(4)]
