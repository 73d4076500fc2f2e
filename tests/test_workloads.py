"""Workloads: the promised shapes, seeded, with arrival processes whose statistics match their parameters."""

from __future__ import annotations

import math

import numpy as np
import pytest

from labkit.serving.workloads import (
    WORKLOADS,
    WorkloadRequest,
    arrival_times,
    default_corpus,
    make_workload,
    text_prompts,
)

VOCAB = {"vocab_size": 1000, "special_ids": (0, 1)}


class CharTokenizer:
    """One token per character: token counts equal text lengths, so slices can be checked exactly."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


CORPUS = "".join(f"Line {i}: to be, or not to be, that is the question.\n" for i in range(400))


def test_long_tail_shape():
    workload = make_workload("long-tail", **VOCAB)
    assert len(workload) == 32
    assert all(16 <= len(r.prompt) <= 128 for r in workload)
    long = [r for r in workload if r.max_new_tokens == 256]
    short = [r for r in workload if r.max_new_tokens != 256]
    assert len(long) == 4
    assert len(short) == 28 and all(16 <= r.max_new_tokens <= 64 for r in short)
    assert all(r.arrival_time == 0.0 for r in workload)  # offline by default


@pytest.mark.parametrize(("n", "num_long"), [(64, 8), (8, 1), (100, 13), (4, 1), (3, 0)])  # round(n / 8), halves up
def test_long_tail_scales_one_in_eight(n, num_long):
    workload = make_workload("long-tail", n, **VOCAB)
    assert len(workload) == n
    assert sum(r.max_new_tokens == 256 for r in workload) == num_long


def test_seeded():
    first = make_workload("sharegpt-like", 20, seed=3, rate=2.0, **VOCAB)
    assert first == make_workload("sharegpt-like", 20, seed=3, rate=2.0, **VOCAB)
    assert first != make_workload("sharegpt-like", 20, seed=4, rate=2.0, **VOCAB)


def test_same_requests_at_every_rate():
    offline = make_workload("uniform", 10, seed=1, **VOCAB)
    online = make_workload("uniform", 10, seed=1, rate=5.0, burstiness=0.5, **VOCAB)
    assert [(r.prompt, r.max_new_tokens) for r in offline] == [(r.prompt, r.max_new_tokens) for r in online]


def test_token_ids_avoid_special_ids():
    workload = make_workload("uniform", 50, vocab_size=5, special_ids=(0, 1, 4))
    tokens = {t for r in workload for t in r.prompt}
    assert tokens == {2, 3}  # everything else is excluded, and both allowed ids show up


def test_uniform_ranges():
    workload = make_workload("uniform", 300, prompt_len=(5, 7), output_len=(2, 3), **VOCAB)
    assert {len(r.prompt) for r in workload} == {5, 6, 7}  # inclusive on both ends
    assert {r.max_new_tokens for r in workload} == {2, 3}


def test_sharegpt_like_statistics():
    workload = make_workload("sharegpt-like", 4000, max_len=100_000, **VOCAB)
    prompts = np.array([len(r.prompt) for r in workload])
    outputs = np.array([r.max_new_tokens for r in workload])
    # log-normal with sigma 1: mean as published, median = mean * exp(-1/2)
    assert prompts.mean() == pytest.approx(161.31, rel=0.1)
    assert outputs.mean() == pytest.approx(337.99, rel=0.1)
    assert np.median(outputs) == pytest.approx(337.99 * math.exp(-0.5), rel=0.1)
    clipped = make_workload("sharegpt-like", 500, max_len=200, **VOCAB)
    assert max(max(len(r.prompt), r.max_new_tokens) for r in clipped) == 200
    assert min(min(len(r.prompt), r.max_new_tokens) for r in clipped) >= 1


def test_shared_prefix():
    workload = make_workload("shared-prefix", 10, prefix_len=40, suffix_len=(3, 6), **VOCAB)
    prefix = workload[0].prompt[:40]
    assert all(r.prompt[:40] == prefix for r in workload)
    assert all(43 <= len(r.prompt) <= 46 for r in workload)
    assert len({tuple(r.prompt[40:]) for r in workload}) == 10  # each question is its own


def test_text_prompts_are_corpus_slices():
    workload = make_workload("uniform", 12, prompt_len=(20, 90), tokenizer=CharTokenizer(), corpus=CORPUS)
    lengths = make_workload("uniform", 12, prompt_len=(20, 90), **VOCAB)
    for text, ids in zip(workload, lengths, strict=True):
        assert isinstance(text.prompt, str)
        assert text.prompt in CORPUS
        assert text.prompt.startswith("Line ")  # cut at a line start
        assert len(text.prompt) == len(ids.prompt)  # same seed, same wanted lengths
    shared = make_workload("shared-prefix", 4, prefix_len=50, tokenizer=CharTokenizer(), corpus=CORPUS)
    assert len({r.prompt[:50] for r in shared}) == 1


def test_text_prompt_longer_than_corpus():
    with pytest.raises(ValueError, match="fewer than"):
        make_workload("uniform", 1, prompt_len=(500, 500), tokenizer=CharTokenizer(), corpus="short text\n" * 10)


def test_sampling_params():
    params = WorkloadRequest([5, 6], 17).sampling_params()
    assert params.max_new_tokens == 17 and params.ignore_eos
    assert not WorkloadRequest([5, 6], 17).sampling_params(ignore_eos=False).ignore_eos


def test_offline_arrivals():
    assert arrival_times(4) == [0.0] * 4
    assert arrival_times(3, rate=math.inf) == [0.0] * 3


def test_poisson_arrivals():
    rate, n = 4.0, 4000
    times = np.array(arrival_times(n, rate=rate, rng=np.random.default_rng(0)))
    assert times[0] > 0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times, prepend=0.0)
    # mean gap 1/rate; its standard error is (1/rate)/sqrt(n) ~ 0.004: allow 5 of them
    assert gaps.mean() == pytest.approx(1 / rate, abs=5 * 0.25 / math.sqrt(n))
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential gaps: CV = 1
    # arrivals in [0, 500 s) are Poisson with mean 2000 and sd ~45: allow 5 sd
    assert abs(np.sum(times < 500) - rate * 500) < 5 * math.sqrt(rate * 500)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_sets_gap_spread(burstiness):
    times = np.array(arrival_times(4000, rate=2.0, burstiness=burstiness, rng=np.random.default_rng(1)))
    gaps = np.diff(times, prepend=0.0)
    assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.15)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"name": "bursty"}, ValueError, "unknown workload 'bursty'"),
        ({"rate": 0}, ValueError, "rate must be > 0"),
        ({"rate": -2.0}, ValueError, "rate must be > 0"),
        ({"rate": float("nan")}, ValueError, "rate must be > 0"),
        ({"rate": "fast"}, TypeError, "rate must be a number"),
        ({"burstiness": 0}, ValueError, "burstiness must be a positive"),
        ({"num_requests": -1}, ValueError, "num_requests must be >= 1, got -1"),
        ({"num_requests": 0}, ValueError, "num_requests must be >= 1"),
        ({"num_requests": 2.5}, TypeError, "num_requests must be an int"),
        ({"prompt_len": (10, 5)}, ValueError, "prompt_len must have low <= high"),
        ({"prompt_len": (-1, 5)}, ValueError, "prompt_len low must be >= 1"),
        ({"output_len": 5}, TypeError, "output_len must be a"),
        ({"max_len": 100}, ValueError, "unknown option 'max_len' for workload 'uniform'"),
        ({"vocab_size": None}, ValueError, "exactly one of vocab_size"),
        ({"tokenizer": CharTokenizer()}, ValueError, "exactly one of vocab_size"),
        ({"vocab_size": 3, "special_ids": (0, 1, 2)}, ValueError, "whole vocabulary"),
        ({"special_ids": (0, 100)}, ValueError, r"special id 100 is outside the vocabulary \[0, 100\)"),
        ({"special_ids": (-1,)}, ValueError, "special id -1 is outside"),
        ({"burstiness": 2.0}, ValueError, "burstiness 2.0 shapes the gaps between arrivals.*give a finite rate too"),
        ({"rate": 1e-200, "burstiness": 1e-200}, ValueError, "rate 1e-200 is too small"),  # their product underflows
        ({"vocab_size": None, "tokenizer": CharTokenizer(), "corpus": 123}, TypeError, "corpus must be the text.*int"),
        ({"vocab_size": None, "tokenizer": CharTokenizer(), "corpus": " \n"}, ValueError, "corpus has no text"),
    ],
)
def test_bad_options(kwargs, error, message):
    args = {"name": "uniform", "num_requests": 4, "vocab_size": 100} | kwargs
    with pytest.raises(error, match=message):
        make_workload(args.pop("name"), args.pop("num_requests"), **args)


def test_numpy_numbers_are_as_good_as_pythons():
    """Counts, seeds and rates computed with numpy (np.int64, np.float64) were refused as not ints."""
    as_numpy = make_workload("uniform", np.int64(6), seed=np.int64(2), rate=np.float64(2.0), vocab_size=np.int64(100))
    assert as_numpy == make_workload("uniform", 6, seed=2, rate=2.0, vocab_size=100)


def test_every_workload_runs_with_defaults():
    for name in WORKLOADS:
        workload = make_workload(name, 16, rate=1.0, **VOCAB)
        assert len(workload) == 16
        assert all(r.max_new_tokens >= 1 and r.prompt for r in workload)


def test_text_prompts_default_to_the_bundled_corpus():
    corpus = default_corpus()
    workload = make_workload("uniform", 5, tokenizer=CharTokenizer())
    assert all(isinstance(r.prompt, str) and r.prompt in corpus for r in workload)


def test_short_text_prompts_start_at_random_lines():
    # A prompt much shorter than the 64-character margin of the window still starts at a random line of the corpus,
    # not always at the first.
    prompts = text_prompts([8] * 20, CharTokenizer(), np.random.default_rng(0), CORPUS)
    assert all(p.startswith("Line ") and len(p) == 8 for p in prompts)
    assert len(set(CORPUS.find(p) for p in prompts)) > 1
    workload = make_workload("uniform", 20, prompt_len=(4, 12), tokenizer=CharTokenizer(), corpus=CORPUS)
    assert len({r.prompt for r in workload}) > 1


def test_a_window_drawn_at_the_very_start_of_the_corpus_starts_there():
    # With a corpus one character longer than the first window (int(1.5 * 20) + 64 = 94 characters for 20 tokens of
    # one character each), the only possible start is 0: the corpus's own first line.
    corpus = CORPUS[:95]
    for seed in range(5):
        (prompt,) = text_prompts([20], CharTokenizer(), np.random.default_rng(seed), corpus)
        assert prompt == corpus[:20]


def test_a_prompt_as_long_as_the_whole_corpus_is_the_whole_corpus():
    corpus = CORPUS[:300]
    (prompt,) = text_prompts([len(corpus)], CharTokenizer(), np.random.default_rng(0), corpus)
    assert prompt == corpus
