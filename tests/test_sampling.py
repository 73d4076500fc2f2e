"""The sampler: filters checked against hand-computed distributions, and seeds that survive batching and preemption.

Threads: torch runs on 1 thread.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from labkit import Engine, EngineConfig, SamplingParams
from labkit.runtime.sampling import Sampler, checked_samples, feed_back_samples, seeded_uniform

torch.set_num_threads(1)


def draw(logits: list[float], uniform: float, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> int:
    return (
        Sampler()
        .sample_rows(
            torch.tensor([logits]),
            temperature=torch.tensor([temperature]),
            top_k=torch.tensor([top_k]),
            top_p=torch.tensor([top_p]),
            uniform=torch.tensor([uniform], dtype=torch.float64),
        )
        .item()
    )


def expected_token(logits: list[float], uniform: float, temperature: float, top_k: int, top_p: float) -> int:
    """Reference inverse-CDF sampling in plain Python: temperature, then top-k, then the top-p nucleus."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k:
        order = order[:top_k]
    weights = [math.exp((logits[i] - logits[order[0]]) / temperature) for i in order]
    probs = [w / sum(weights) for w in weights]
    kept, mass = [], 0.0
    for token, p in zip(order, probs, strict=True):
        if mass >= top_p:
            break
        kept.append((token, p))
        mass += p
    target, acc = uniform * sum(p for _, p in kept), 0.0
    for token, p in kept:
        acc += p
        if acc > target:
            return token
    return kept[-1][0]


def test_seeded_uniform_depends_only_on_seed_and_index():
    values = [seeded_uniform(7, i) for i in range(2000)]
    assert values == [seeded_uniform(7, i) for i in range(2000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03  # roughly uniform
    assert len(set(values)) == len(values)
    assert seeded_uniform(8, 0) != seeded_uniform(7, 0)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 3, 1.0), (1.0, 0, 0.6), (0.7, 4, 0.8), (1.3, 1, 1.0)],
)
def test_filters_match_a_hand_computed_distribution(temperature, top_k, top_p):
    logits = [0.1, 2.0, -1.0, 1.5, 0.3, 1.9, -0.5, 0.0]
    rng = random.Random(0)
    for _ in range(50):
        u = rng.random()
        assert draw(logits, u, temperature, top_k, top_p) == expected_token(logits, u, temperature, top_k, top_p)


def test_top_k_and_top_p_restrict_the_support():
    logits = [3.0, 2.5, 2.0, 0.0, -1.0, -2.0]
    grid = [i / 1000 for i in range(1000)]
    assert {draw(logits, u, top_k=2) for u in grid} == {0, 1}
    # Softmax mass: token 0 has 0.49, tokens 0-1 0.78, so top_p=0.7 keeps exactly tokens 0 and 1; token 5 has 0.003.
    assert {draw(logits, u, top_p=0.7) for u in grid} == {0, 1}
    assert {draw(logits, u, top_p=1e-6) for u in grid} == {0}
    assert {draw(logits, u) for u in grid} == set(range(6))
    # The nucleus is the smallest prefix whose mass reaches top_p: exactly reaching it ends the nucleus.
    assert {draw([0.0, 0.0], u, top_p=0.5) for u in grid} == {0}
    assert {draw([0.0] * 4, u, top_p=0.5) for u in grid} == {0, 1}


def test_ties_are_walked_in_vocabulary_order():
    """Equal logits keep their vocabulary order, as in the plain-Python reference (a stable sort)."""
    logits = [1.0 if i % 3 == 0 else 0.0 for i in range(300)]
    assert draw(logits, 0.99, top_k=1) == draw(logits, 0.0, top_k=1) == 0  # what argmax picks
    assert {draw(logits, u, top_k=3) for u in (0.1, 0.5, 0.9)} == {0, 3, 6}
    rng = random.Random(0)
    for _ in range(50):
        u = rng.random()
        assert draw(logits, u, top_p=0.5) == expected_token(logits, u, 1.0, 0, 0.5)


def test_sampler_mixes_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 3.9], [0.0, 0.0, 9.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0, top_k=1)]
    tokens = Sampler()(logits, params, [0, 5, 2])
    assert tokens[0] == 1 and tokens[2] == 2
    assert tokens[1] == expected_token([4.0, 0.0, 3.9], seeded_uniform(3, 5), 1.0, 0, 1.0)
    with pytest.raises(ValueError, match="logits rows"):
        Sampler()(logits, params[:2], [0, 1])


SEEDED = SamplingParams(max_new_tokens=24, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)


def others(rng: random.Random, vocab: int, count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(count)]
    params = [
        SamplingParams(max_new_tokens=rng.randint(1, 30), temperature=rng.choice([0.0, 0.7, 1.2]), seed=s, top_k=5)
        for s in (rng.choice([None, rng.randrange(100)]) for _ in range(count))
    ]
    return prompts, params


def test_seeded_request_gives_the_same_tokens_alone_in_a_batch_and_after_preemption(tiny_model):
    model = tiny_model("llama")
    rng = random.Random(0)
    prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(37)]
    alone = Engine(model, EngineConfig(block_size=8, num_blocks=64)).generate([prompt], SEEDED)[0].output_token_ids
    assert len(alone) == 24

    prompts, params = others(rng, model.config.vocab_size, 31)
    prompts.insert(13, prompt)
    params.insert(13, SEEDED)
    batched = Engine(model, EngineConfig(block_size=8, num_blocks=400, max_num_seqs=32)).generate(prompts, params)
    assert batched[13].output_token_ids == alone

    tight = Engine(model, EngineConfig(block_size=8, num_blocks=24, max_batch_tokens=64, max_num_seqs=32))
    preempted = []
    tight.step_listeners.append(lambda report: preempted.extend(report.preempted))
    after_preemption = tight.generate(prompts, params)
    assert preempted, "the cache was meant to be too small to run everything at once"
    assert after_preemption[13].output_token_ids == alone
    assert tight.num_free_blocks == tight.num_blocks

    other_seed = SamplingParams(**{**vars(SEEDED), "seed": 99})
    reseeded = Engine(model, EngineConfig(block_size=8, num_blocks=64)).generate([prompt], other_seed)[0]
    assert reseeded.output_token_ids != alone


def test_unseeded_sampling_varies_and_stays_in_the_vocabulary(tiny_model):
    model = tiny_model("qwen2")
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=64))
    params = SamplingParams(max_new_tokens=16, temperature=1.5, ignore_eos=True)
    first, second = (engine.generate([[5, 6, 7]], params)[0].output_token_ids for _ in range(2))
    assert first != second
    assert all(0 <= t < model.config.vocab_size for t in first + second)


def test_seeded_uniform_mixes_every_input_bit_into_every_output_bit():
    """Splitmix-style mixing: flipping any one of the 64 bits of the seed or of the index flips each of the 53
    output bits about half the time (the avalanche criterion), and each output bit is 1 about half the time. A
    weaker mix would tie nearby seeds' or indices' draws to each other, or skew the low bits of every draw."""
    rng = random.Random(0)
    trials = 200
    for flip_seed in (True, False):
        for bit in range(64):
            flipped = 0
            for _ in range(trials):
                seed, index = rng.getrandbits(64), rng.getrandbits(64)
                a = seeded_uniform(seed, index)
                b = seeded_uniform(seed ^ (1 << bit), index) if flip_seed else seeded_uniform(seed, index ^ (1 << bit))
                flipped += bin(int(a * 2**53) ^ int(b * 2**53)).count("1")
            what = "seed" if flip_seed else "index"
            assert 0.44 < flipped / (trials * 53) < 0.56, f"flipping bit {bit} of the {what}"
    draws = [int(seeded_uniform(7, i) * 2**53) for i in range(2000)]
    for bit in range(53):
        ones = sum(d >> bit & 1 for d in draws)
        assert 0.45 < ones / len(draws) < 0.55, f"output bit {bit} is 1 in {ones} of {len(draws)} draws"


def test_sampler_refuses_a_count_of_indices_or_params_that_differs_from_the_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 3.9], [0.0, 0.0, 9.0]])
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3)]
    with pytest.raises(ValueError, match="3 logits rows, 3 params and 2 indices"):
        Sampler()(logits, params, [0, 1])
    with pytest.raises(ValueError, match="3 logits rows, 3 params and 4 indices"):
        Sampler()(logits, params, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="3 logits rows, 2 params and 3 indices"):
        Sampler()(logits, params[:2], [0, 1, 2])


def test_each_rows_temperature_top_k_top_p_and_seed_reach_its_draw():
    """Through the sampler's own entry point (not sample_rows): every sampled row's token is the reference
    inverse-CDF draw with that row's parameters and its seeded uniform, greedy rows stay argmax."""
    logits_row = [0.1, 2.0, -1.0, 1.5, 0.3, 1.9, -0.5, 0.0]
    settings = [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 3, 1.0), (1.0, 0, 0.6), (0.7, 4, 0.8), (1.3, 1, 1.0), (1.0, 2, 1.0)]
    rows, params, indices = [], [], []
    for seed in range(40):
        for temperature, top_k, top_p in settings:
            rows.append(logits_row)
            params.append(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
            indices.append(seed * 3 + top_k)
        rows.append(logits_row)
        params.append(SamplingParams())
        indices.append(seed)
    tokens = Sampler()(torch.tensor(rows), params, indices)
    for token, p, index in zip(tokens, params, indices, strict=True):
        if p.greedy:
            assert token == 1
        else:
            u = seeded_uniform(p.seed, index)
            assert token == expected_token(logits_row, u, p.temperature, p.top_k, p.top_p), (p, index)


@pytest.mark.parametrize("logits", [[1.0, 3.0, 2.0], [-5.0, -1.0, -3.0], [30.0, 31.0, -30.0]])
def test_a_temperature_at_the_bottom_of_float32_still_picks_the_most_likely_token(logits):
    # Scaling by 1 / 1e-38 would overflow float32 (max ~3.4e38) unless the largest logit is shifted to 0 first.
    best = max(range(len(logits)), key=logits.__getitem__)
    for u in [i / 100 for i in range(100)]:
        assert draw(logits, u, temperature=1e-38) == best
        assert draw(logits, u, temperature=1e-45) == best


@pytest.fixture(params=[False, True], ids=["subnormals", "flush-to-zero"])
def flush_denormal(request):
    """Runs a test as is, then with subnormal floats read as 0, as on devices that flush them to zero."""
    if request.param and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormal floats to zero")
    yield request.param
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("top_p", [1e-39, 1e-45, 1e-46, 1e-300])
def test_a_top_p_below_float32s_normal_range_keeps_the_most_likely_token(top_p, flush_denormal):
    # float32 holds 1e-46 and 1e-300 as 0, and a flush-to-zero device reads the subnormals 1e-39 and 1e-45 as 0;
    # a nucleus of top_p 0 would drop every token, the most likely one included. Each row draws the greedy token.
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [-5.0, -3.0, -1.0, -4.0], [9.0, 8.0, 8.5, -2.0]])
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=seed) for seed in range(3)]
    for index in range(20):
        assert Sampler().sample(logits, params, [index] * 3).tolist() == logits.argmax(dim=-1).tolist()
    assert draw([0.0, 3.0, 1.0, 2.0], 0.5, top_p=top_p) == 1


def test_sample_leaves_the_tokens_on_the_logits_device():
    """sample() moves every per-row value to the logits' device and returns the tokens there. The shape-only
    'meta' device stands in for a GPU: a value left on the host could not index the logits there."""
    logits = torch.zeros(3, 10, device="meta")
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.5, top_k=3)]
    tokens = Sampler().sample(logits, params, [0, 1, 2])
    assert tokens.device == logits.device
    assert tokens.shape == (3,)


def test_a_uniform_exactly_on_a_cumulative_boundary_picks_the_next_token():
    # Four equal logits: probability 1/4 each, cumulative 1/4, 1/2, 3/4, 1, all exact. The token is the first whose
    # cumulative probability *exceeds* the uniform, so u = k/4 already picks the (k+1)-th token, as u = k/4 + 1/8 does.
    logits = [0.0, 0.0, 0.0, 0.0]
    tokens = [draw(logits, k / 4) for k in range(4)]
    assert sorted(tokens) == [0, 1, 2, 3]
    assert tokens == [draw(logits, k / 4 + 1 / 8) for k in range(4)]


def test_feed_back_replaces_only_the_negative_placeholders():
    # Token 0 is a real token id (as is every id >= 0); only -1 - i stands for the previous step's sample i.
    input_ids = torch.tensor([0, 5, -1, 0, -2, 7])
    samples = torch.tensor([11, 12])
    feed_back_samples(input_ids, samples)
    assert input_ids.tolist() == [0, 5, 11, 0, 12, 7]


def test_a_temperature_below_float32s_range_is_greedy():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    for seed in range(20):
        assert Sampler()(logits, [SamplingParams(temperature=1e-50, seed=seed)], [0]) == [1]


def test_checked_samples_refuses_the_token_equal_to_the_vocabulary_size():
    assert checked_samples([0, 3], 4, torch.device("cpu"), [7, 8]) == [0, 3]
    with pytest.raises(ValueError, match="row 1"):
        checked_samples([0, 4], 4, torch.device("cpu"), [7, 8])
