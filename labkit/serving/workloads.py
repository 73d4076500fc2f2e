"""Seeded benchmark workloads: which requests arrive, how long they are, and when they come.

Batching policies differ most when requests differ, so each workload is a *shape* of traffic:

* ``"long-tail"`` - prompts of 16-128 tokens; 7 in 8 requests want 16-64 new tokens, 1 in 8 wants
  256. A static batch waits for its longest member, so the few long ones stall everyone else.
* ``"uniform"`` - prompt and output lengths drawn uniformly from given ranges.
* ``"sharegpt-like"`` - log-normal lengths shaped like real chat traffic (see :func:`sharegpt_like_lengths`).
* ``"shared-prefix"`` - every prompt starts with the same long system prompt (what prefix caching exploits).

Prompts are token ids drawn from the model's vocabulary (``vocab_size``, avoiding ``special_ids``), or,
when a ``tokenizer`` is given, slices of real text (the bundled Tiny Shakespeare corpus by default).
Arrivals are all at once (offline throughput), or a Poisson process at ``rate`` requests per second, or
gamma-distributed gaps with a ``burstiness`` (online serving). Lengths, prompt contents and arrivals
use separate random streams, so the same seed gives the same requests at every rate.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import numpy as np

from labkit.core.request import SamplingParams, as_seconds

DEFAULT_NUM_REQUESTS = 32
LONG_TAIL_RATIO = 8  # one request in eight is long

# ShareGPT means from Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention" (SOSP 2023), Fig. 11: ShareGPT prompts average 161.31 tokens and outputs 337.99.
SHAREGPT_MEAN_PROMPT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
SHAREGPT_SIGMA = 1.0  # our estimate of the log-normal spread (the paper gives histograms, not a spread)

_STREAM_LENGTHS, _STREAM_PROMPTS, _STREAM_ARRIVALS = range(3)


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a workload: its prompt, how many tokens it wants, and when (seconds from start) it comes."""

    prompt: list[int] | str
    max_new_tokens: int
    arrival_time: float = 0.0

    def __post_init__(self) -> None:
        # The token ids themselves are checked by the engine, which knows the vocabulary.
        if not isinstance(self.prompt, (str, list, tuple)):
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(self.prompt).__name__}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, numbers.Integral):
            raise TypeError(f"max_new_tokens must be an int, got {type(self.max_new_tokens).__name__}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        arrival_time = as_seconds("arrival_time", self.arrival_time)
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "arrival_time", arrival_time)

    def sampling_params(self, *, ignore_eos: bool = True) -> SamplingParams:
        """Greedy params for exactly ``max_new_tokens`` tokens (unless ``ignore_eos=False`` lets EOS stop it)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, ignore_eos=ignore_eos)


# ---------------------------------------------------------------------------------------------- lengths
def long_tail_lengths(
    n: int,
    rng: np.random.Generator,
    *,
    prompt_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (16, 64),
    long_output_len: int = 256,
) -> list[tuple[int, int]]:
    """(prompt, output) lengths where ``round(n / 8)`` requests, at random positions, want ``long_output_len``."""
    _check_range("prompt_len", prompt_len)
    _check_range("output_len", output_len)
    _check_positive("long_output_len", long_output_len)
    prompts = _uniform_ints(rng, prompt_len, n)
    outputs = _uniform_ints(rng, output_len, n)
    num_long = math.floor(n / LONG_TAIL_RATIO + 0.5)
    outputs[rng.permutation(n)[:num_long]] = long_output_len
    return list(zip(prompts.tolist(), outputs.tolist(), strict=True))


def uniform_lengths(
    n: int,
    rng: np.random.Generator,
    *,
    prompt_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (16, 64),
) -> list[tuple[int, int]]:
    """(prompt, output) lengths drawn uniformly from the inclusive ranges."""
    _check_range("prompt_len", prompt_len)
    _check_range("output_len", output_len)
    prompts, outputs = _uniform_ints(rng, prompt_len, n), _uniform_ints(rng, output_len, n)
    return list(zip(prompts.tolist(), outputs.tolist(), strict=True))


def sharegpt_like_lengths(n: int, rng: np.random.Generator, *, max_len: int = 1024) -> list[tuple[int, int]]:
    """(prompt, output) lengths from log-normals matching ShareGPT's published means, clipped to [1, max_len].

    Means: 161.31 prompt and 337.99 output tokens, from Kwon et al., "Efficient Memory Management for
    Large Language Model Serving with PagedAttention" (SOSP 2023), Fig. 11. Spread: sigma = 1.0 for both,
    our estimate from the long right tails of those histograms (the paper publishes no spread), which puts
    the medians at about 0.61x the means. Clipping at ``max_len`` lowers the means a little.
    """
    _check_positive("max_len", max_len)
    mu_offset = SHAREGPT_SIGMA**2 / 2  # mean of a log-normal is exp(mu + sigma^2 / 2)
    prompts = rng.lognormal(math.log(SHAREGPT_MEAN_PROMPT) - mu_offset, SHAREGPT_SIGMA, n)
    outputs = rng.lognormal(math.log(SHAREGPT_MEAN_OUTPUT) - mu_offset, SHAREGPT_SIGMA, n)
    return list(zip(_clip(prompts, max_len), _clip(outputs, max_len), strict=True))


def shared_prefix_lengths(
    n: int,
    rng: np.random.Generator,
    *,
    prefix_len: int = 256,
    suffix_len: tuple[int, int] = (16, 64),
    output_len: tuple[int, int] = (16, 64),
) -> list[tuple[int, int]]:
    """(prompt, output) lengths where every prompt is a ``prefix_len``-token system prompt plus its own question."""
    _check_positive("prefix_len", prefix_len)
    _check_range("suffix_len", suffix_len)
    _check_range("output_len", output_len)
    prompts, outputs = prefix_len + _uniform_ints(rng, suffix_len, n), _uniform_ints(rng, output_len, n)
    return list(zip(prompts.tolist(), outputs.tolist(), strict=True))


LengthSampler = Callable[..., list[tuple[int, int]]]
WORKLOADS: dict[str, LengthSampler] = {
    "long-tail": long_tail_lengths,
    "uniform": uniform_lengths,
    "sharegpt-like": sharegpt_like_lengths,
    "shared-prefix": shared_prefix_lengths,
}


# ---------------------------------------------------------------------------------------------- arrivals
def arrival_times(
    n: int, rate: float | None = None, burstiness: float = 1.0, rng: np.random.Generator | None = None
) -> list[float]:
    """Seconds from the start at which each of ``n`` requests arrives, in order.

    ``rate=None`` (or infinity) puts every arrival at 0: the offline throughput setting. Otherwise the gaps
    are gamma-distributed with mean ``1 / rate`` and shape ``burstiness``: 1 is a Poisson process, below
    1 arrivals come in bursts (the gaps' coefficient of variation is ``1 / sqrt(burstiness)``), above 1
    they come more evenly.
    """
    _check_count("num_requests", n)
    if isinstance(burstiness, bool) or not isinstance(burstiness, numbers.Real):
        raise TypeError(f"burstiness must be a number, got {type(burstiness).__name__}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if rate is None or rate == math.inf:
        if burstiness != 1:
            raise ValueError(
                f"burstiness {burstiness} shapes the gaps between arrivals, and with no rate (or an infinite one)"
                " every request arrives at once: give a finite rate too"
            )
        return [0.0] * int(n)
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        raise TypeError(f"rate must be a number of requests per second, got {type(rate).__name__}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second (or None for all at once), got {rate}")
    per_second = rate * burstiness  # 0.0 where two tiny numbers underflow
    mean_gap = 1 / per_second if per_second > 0 else math.inf
    if not math.isfinite(mean_gap):
        raise ValueError(f"rate {rate} is too small: the arrival times would not be finite")
    rng = rng if rng is not None else np.random.default_rng()
    gaps = rng.gamma(shape=burstiness, scale=mean_gap, size=n)
    return np.cumsum(gaps).tolist()


# ---------------------------------------------------------------------------------------------- prompts
def random_token_prompts(
    lengths: Iterable[int], vocab_size: int, rng: np.random.Generator, *, special_ids: Iterable[int] = ()
) -> list[list[int]]:
    """Prompts of the given lengths with token ids drawn uniformly from the vocabulary minus ``special_ids``."""
    _check_positive("vocab_size", vocab_size)
    if isinstance(special_ids, (str, bytes)) or not isinstance(special_ids, Iterable):
        raise TypeError(f"special_ids must be a collection of token ids, got {type(special_ids).__name__}")
    special = list(special_ids)
    for token in special:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"special_ids must be ints, got {type(token).__name__}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"special id {token} is outside the vocabulary [0, {vocab_size})")
    allowed = np.setdiff1d(np.arange(vocab_size), np.array(special, dtype=int))
    if allowed.size == 0:
        raise ValueError(f"special_ids cover the whole vocabulary of {vocab_size}: no token id left for prompts")
    return [allowed[rng.integers(0, allowed.size, n)].tolist() for n in lengths]


def text_prompts(lengths: Iterable[int], tokenizer: Any, rng: np.random.Generator, corpus: str) -> list[str]:
    """Slices of ``corpus`` (each starting at a line) of about the given lengths in ``tokenizer``'s tokens."""
    sample = corpus[:4000]
    chars_per_token = len(sample) / max(1, len(tokenizer.encode(sample, add_special_tokens=False)))
    return [_text_slice(n, tokenizer, rng, corpus, chars_per_token) for n in lengths]


def default_corpus() -> str:
    """The bundled text corpus (Tiny Shakespeare) that text prompts are cut from."""
    return _read_corpus()


@lru_cache(maxsize=1)
def _read_corpus() -> str:
    path = resources.files("labkit") / "data" / "tinyshakespeare.txt"
    if not path.is_file():
        raise FileNotFoundError(f"the bundled corpus {path} is missing; pass corpus= explicitly")
    return path.read_text(encoding="utf-8")


def _text_slice(num_tokens: int, tokenizer: Any, rng: np.random.Generator, corpus: str, chars_per_token: float) -> str:
    """Encode a window of text at a random line, growing it until it holds ``num_tokens`` tokens; decode those."""
    window = int(num_tokens * chars_per_token * 1.5) + 64
    while True:
        if window >= len(corpus):
            start, window = 0, len(corpus)
        else:
            start = int(rng.integers(0, len(corpus) - window))
            start = corpus.find("\n", start) + 1 if start else 0  # begin at a line, not mid-word
        ids = tokenizer.encode(corpus[start : start + window], add_special_tokens=False)
        if len(ids) >= num_tokens:
            return tokenizer.decode(ids[:num_tokens])
        if window == len(corpus):
            raise ValueError(f"the corpus has {len(ids)} tokens, fewer than the {num_tokens} a prompt needs")
        window *= 2


# ---------------------------------------------------------------------------------------------- workloads
def make_workload(
    name: str,
    num_requests: int | None = None,
    *,
    seed: int = 0,
    rate: float | None = None,
    burstiness: float = 1.0,
    vocab_size: int | None = None,
    special_ids: Iterable[int] = (),
    tokenizer: Any = None,
    corpus: str | None = None,
    **options: Any,
) -> list[WorkloadRequest]:
    """A seeded workload of ``num_requests`` requests (default 32), in arrival order.

    Give ``vocab_size`` (and the ``special_ids`` to avoid) for token-id prompts, or a ``tokenizer`` for
    real-text prompts. ``options`` go to the workload's length sampler, e.g. ``prompt_len=(8, 32)`` for
    ``"uniform"`` or ``max_len=512`` for ``"sharegpt-like"``; see :data:`WORKLOADS`.
    """
    sampler = WORKLOADS.get(name)
    if sampler is None:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    n = DEFAULT_NUM_REQUESTS if num_requests is None else num_requests
    _check_positive("num_requests", n)
    _check_count("seed", seed)
    n, seed = int(n), int(seed)  # numpy's integers too
    _check_options(name, sampler, options)
    if (vocab_size is None) == (tokenizer is None):
        raise ValueError("give exactly one of vocab_size (token-id prompts) or tokenizer (text prompts)")
    if tokenizer is not None and not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must have an encode() method, as transformers' do; got {type(tokenizer).__name__}")
    if corpus is not None and not isinstance(corpus, str):
        raise TypeError(f"corpus must be the text to cut prompts from (a str), got {type(corpus).__name__}")
    if corpus is not None and not corpus.strip():
        raise ValueError(f"corpus has no text to cut prompts from: {corpus!r}")

    def stream(kind: int) -> np.random.Generator:
        return np.random.default_rng([seed, kind])

    lengths = sampler(n, stream(_STREAM_LENGTHS), **options)
    arrivals = arrival_times(n, rate, burstiness, stream(_STREAM_ARRIVALS))
    settings = {**(sampler.__kwdefaults__ or {}), **options}
    prefix_len = settings["prefix_len"] if name == "shared-prefix" else 0
    prompt_rng = stream(_STREAM_PROMPTS)
    prompt_lens = [p - prefix_len for p, _ in lengths]
    if tokenizer is not None:
        text = default_corpus() if corpus is None else corpus
        prompts: list[Any] = text_prompts(prompt_lens, tokenizer, prompt_rng, text)
        if prefix_len:
            prefix = text_prompts([prefix_len], tokenizer, prompt_rng, text)[0]
            prompts = [prefix + p for p in prompts]
    else:
        prompts = random_token_prompts(prompt_lens, vocab_size, prompt_rng, special_ids=special_ids)
        if prefix_len:
            prefix_ids = random_token_prompts([prefix_len], vocab_size, prompt_rng, special_ids=special_ids)[0]
            prompts = [prefix_ids + p for p in prompts]
    return [
        WorkloadRequest(prompt, out, arrival)
        for prompt, (_, out), arrival in zip(prompts, lengths, arrivals, strict=True)
    ]


# ---------------------------------------------------------------------------------------------- checks
def _check_options(name: str, sampler: LengthSampler, options: dict[str, Any]) -> None:
    known = sampler.__kwdefaults__ or {}
    for option in options:
        if option not in known:
            raise ValueError(f"unknown option {option!r} for workload {name!r}; it takes {sorted(known)}")


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_range(name: str, value: object) -> None:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{name} must be a (low, high) pair of ints, got {value!r}")
    low, high = value
    _check_positive(f"{name} low", low)
    _check_positive(f"{name} high", high)
    if low > high:
        raise ValueError(f"{name} must have low <= high, got {value!r}")


def _clip(lengths: np.ndarray, max_len: int) -> list[int]:
    return np.clip(np.rint(lengths), 1, max_len).astype(int).tolist()


def _uniform_ints(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> np.ndarray:
    return rng.integers(bounds[0], bounds[1] + 1, n)
