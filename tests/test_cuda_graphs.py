"""CUDA graphs for decode steps give the same tokens as eager steps (skipped without CUDA).

What a graph bakes in must not leak into its results: bucket padding (batch sizes between buckets),
preemption (requests leave and come back recomputed), and contexts longer than any seen at capture
(the graphs are captured with empty contexts, then replayed as contexts grow to hundreds of tokens).
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

from labkit import Engine, EngineConfig, SamplingParams  # noqa: E402
from labkit.models.random import random_model  # noqa: E402


def run(model: torch.nn.Module, prompts: list[list[int]], wanted: list[int], **options: object) -> tuple[Engine, list]:
    config = EngineConfig(device="cuda", attention_backend="triton", **options)
    engine = Engine(model, config)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    return engine, [o.output_token_ids for o in engine.generate(prompts, params)]


def workload(n: int, prompt_len: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_model("qwen2", "tiny", seed=1).to("cuda")


def test_graph_on_by_default_on_cuda(model: torch.nn.Module) -> None:
    engine, _ = run(model, workload(1, (4, 4)), [3], max_num_seqs=4)
    assert engine.runner.use_cuda_graph and engine.runner.graphs.num_replays == 2


def test_same_tokens_across_bucket_boundaries(model: torch.nn.Module) -> None:
    """Requests finish one after another, so the decode batch walks down through 19..1 (buckets 24, 16, 8, 4, 2, 1)."""
    prompts = workload(19, (5, 60))
    wanted = [4 + 3 * i for i in range(19)]
    engine, graphed = run(model, prompts, wanted, max_num_seqs=24)
    _, eager = run(model, prompts, wanted, max_num_seqs=24, use_cuda_graph=False)
    assert engine.runner.graphs.num_replays > 50
    assert graphed == eager


def test_same_tokens_after_preemption(model: torch.nn.Module) -> None:
    prompts = workload(12, (20, 80), seed=2)
    wanted = [60] * 12
    options = dict(max_num_seqs=12, num_blocks=40, block_size=16)
    _, graphed = run(model, prompts, wanted, **options)
    preempted: list[int] = []
    config = EngineConfig(device="cuda", attention_backend="triton", use_cuda_graph=False, **options)
    eager_engine = Engine(model, config)
    eager_engine.step_listeners.append(lambda report: preempted.extend(report.preempted))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    eager = [o.output_token_ids for o in eager_engine.generate(prompts, params)]
    assert preempted, "the workload was meant to preempt"
    assert graphed == eager


def test_contexts_longer_than_at_capture(model: torch.nn.Module) -> None:
    """One engine, graphs captured once: short contexts first, then contexts of 700+ tokens (44+ blocks)."""
    engine = Engine(model, EngineConfig(device="cuda", attention_backend="triton", max_num_seqs=8))
    eager = Engine(model, EngineConfig(device="cuda", attention_backend="triton", max_num_seqs=8, use_cuda_graph=False))
    for prompt_len, new in (((4, 8), 8), ((600, 700), 120)):
        prompts = workload(6, prompt_len, seed=prompt_len[0])
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        graphed = [o.output_token_ids for o in engine.generate(prompts, params)]
        assert graphed == [o.output_token_ids for o in eager.generate(prompts, params)]
