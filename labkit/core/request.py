"""A request's life in the engine: what was asked (SamplingParams), where it stands (Request), what came out.

States: waiting -> prefilling -> decoding -> finished. A preempted request goes back to waiting and
is recomputed from its prompt plus the tokens it already produced; an aborted one finishes at once.
"""

from __future__ import annotations

import math
import numbers
import operator
import reprlib
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

FINISH_REASONS = ("length", "stop", "abort")
#: A generated token whose value is still on the device: with async scheduling, step N+1 is planned while
#: step N runs, so N's new tokens stand in the requests' outputs as this placeholder until N's tokens are read.
PENDING_TOKEN = -1
#: A seed is an int in [0, SEED_RANGE): the sampler draws from its 64 bits.
SEED_RANGE = 2**64


class RequestState(str, Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"

    def __str__(self) -> str:
        """``RequestState.DECODING`` in an f-string on every Python, as it is written in code: Python 3.10 formats a
        str enum as its value ("decoding")."""
        return f"{type(self).__name__}.{self.name}"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``temperature=0`` is greedy; any finite temperature above 0 samples, however small (a tiny one picks
    the most likely token, as its limit, greedy, does). ``top_k=0`` and ``top_p=1.0`` switch those
    filters off. A ``seed`` (an int >= 0) makes sampling reproducible per request: the same request draws
    the same tokens whether it runs alone, in a batch, or is preempted and recomputed. Numbers may be
    any real or integral type, and ``ignore_eos`` any bool (numpy's included, as learners' values often come out of
    numpy); they are stored as Python floats, ints and bools.
    ``priority`` matters only under ``EngineConfig(scheduling="priority")``: lower numbers run first.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    priority: int = 0

    def __post_init__(self) -> None:
        # Any real number is accepted (numpy's float32 as well as float64) and stored as a plain float or int,
        # so the sampler builds its tensors from Python numbers.
        self._set("max_new_tokens", as_int("max_new_tokens", self.max_new_tokens))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self._set("temperature", _as_float("temperature", self.temperature))
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        self._set("top_k", as_int("top_k", self.top_k))
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        self._set("top_p", _as_float("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            self._set("seed", as_int("seed", self.seed))
            if not 0 <= self.seed < SEED_RANGE:  # the sampler draws from the seed's 64 bits: a larger one would alias
                raise ValueError(f"seed must be in [0, 2**64) (or None), got {self.seed}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError("stop_token_ids must be a sequence of ints")
        self._set("stop_token_ids", tuple(as_int("stop_token_ids item", t) for t in self.stop_token_ids))
        self._set("ignore_eos", as_bool("ignore_eos", self.ignore_eos))
        self._set("priority", as_int("priority", self.priority))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # the dataclass is frozen; only __post_init__ normalizes

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestMetrics:
    """Timestamps on the engine's clock (seconds); the metrics module turns them into TTFT, TPOT, ITL."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0


@dataclass(eq=False)
class Request:
    """One request inside the engine.

    ``num_computed_tokens`` counts the tokens whose keys and values are in the KV cache; the
    scheduler compares it with ``num_tokens`` to know whether the request still has prefill to do
    or is decoding. After a preemption it drops to 0 and the request is recomputed. With prefix
    caching, ``block_hashes`` are the digests of its full blocks (a memo, extended as it grows: a step
    that is rolled back may leave it longer, which changes nothing) and ``num_cached_tokens`` the prompt
    tokens its first admission found in the cache.
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    num_cached_tokens: int | None = None
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    stop_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids |= self.eos_token_ids
        self.stop_ids = frozenset(ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: everything that must be in the cache to decode the next one."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) of prompt + output, without copying the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def finish_reason_for(self, token: int) -> str | None:
        """The finish reason that generating ``token`` next would cause, if any."""
        if token in self.stop_ids:
            return "stop"
        if len(self.output_token_ids) + 1 >= self.params.max_new_tokens:
            return "length"
        return None


@dataclass
class RequestOutput:
    """What ``Engine.generate`` returns for each prompt."""

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str | None
    finish_reason: str | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "output_token_ids": list(self.output_token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "metrics": vars(self.metrics).copy(),
            "num_cached_tokens": self.num_cached_tokens,
        }


def where_outputs_part(
    expected: Sequence[RequestOutput], got: Sequence[RequestOutput], names: tuple[str, str] = ("expected", "got")
) -> str:
    """Where two runs of the same requests part, as one line for a failing check's message ("" if they do not).

    For each request whose outputs differ: the first output token where they do, and each run's token there, so a
    token-for-token check says where a run went its own way (a near-tie flipped, a wrong block read), not only
    that it did. Three requests at most are named.
    """
    if len(expected) != len(got):
        return f"{names[0]} has {len(expected)} outputs, {names[1]} {len(got)}"
    parted = []
    for a, b in zip(expected, got, strict=True):
        first, second = a.output_token_ids, b.output_token_ids
        if first != second:
            pairs = zip(first, second, strict=False)  # one run may have ended earlier
            at = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(first), len(second)))
            tokens = [str(run[at]) if at < len(run) else "no token (it ended)" for run in (first, second)]
            parted.append(
                f"request {a.request_id} parts at output token {at}: {names[0]} {tokens[0]}, {names[1]} {tokens[1]}"
            )
    more = [f"{len(parted) - 3} more requests differ"] if len(parted) > 3 else []
    return "; ".join(parted[:3] + more)


def prompt_token_ids(prompt: object, vocab_size: int | None = None, max_model_len: int | None = None) -> list[int]:
    """A prompt of token ids as a list of Python ints, checked; else a TypeError/ValueError naming what is wrong.

    A prompt is any sequence of integers, of any integer type (``operator.index`` takes it): a list, a tuple, a
    numpy array or a list of numpy's integers, since learners' token ids often come out of numpy. A float or a
    bool is refused, named with its position: 5.0 and True are not token ids. ``vocab_size`` and
    ``max_model_len`` bound the ids and the length; without a vocabulary, only negative ids are refused.
    """
    if not is_token_sequence(prompt):
        raise TypeError(f"prompt must be a list of token ids, got {type(prompt).__name__}")
    token_ids = list(prompt)
    if not token_ids:
        raise ValueError("prompt is empty")
    if not all(type(token) is int for token in token_ids):  # numpy's integers, say: stored as Python ints
        converted = [as_token_id(token) for token in token_ids]
        if None in converted:
            position = converted.index(None)
            bad = token_ids[position]
            raise TypeError(
                f"prompt token ids must be ints, got {type(bad).__name__} {reprlib.repr(bad)} at position {position}"
            )
        token_ids = cast(list[int], converted)
    lowest, highest = min(token_ids), max(token_ids)
    if lowest < 0 or (vocab_size is not None and highest >= vocab_size):
        bad = lowest if lowest < 0 else highest
        where = "negative" if vocab_size is None else f"outside the vocabulary [0, {vocab_size})"
        raise ValueError(f"prompt token id {bad} is {where} (position {token_ids.index(bad)})")
    if max_model_len is not None and len(token_ids) > max_model_len:
        raise ValueError(
            f"prompt ({len(token_ids)} tokens) is longer than the model's maximum length ({max_model_len})"
        )
    return token_ids


def check_request_length(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """ValueError unless the prompt and every generated token but the last fit the model's positions.

    The last token is sampled and never fed back, so it needs no position of its own.
    """
    if num_prompt_tokens + params.max_new_tokens - 1 > max_model_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds"
            f" the model's maximum length ({max_model_len})"
        )


def is_token_sequence(value: object) -> bool:
    """Whether ``value`` can be a prompt of token ids: a sized iterable that is not text, bytes, a mapping or a set."""
    if isinstance(value, (str, bytes, bytearray, memoryview, Mapping, Set)):
        return False
    return hasattr(value, "__len__") and hasattr(value, "__iter__") and getattr(value, "ndim", 1) == 1


_BOOL_DTYPES = ("bool", "torch.bool")  # numpy's and torch's names of their bool dtype


def as_token_id(value: object) -> int | None:
    """``value`` as a Python int if it is one integer of any kind, else None.

    Any kind is whatever ``operator.index`` takes: int, numpy's integers, a 0-d integer tensor. A bool, numpy's
    and torch's included, is not a token id, though Python counts True as 1.
    """
    if isinstance(value, bool) or getattr(value, "ndim", 0) or str(getattr(value, "dtype", "")) in _BOOL_DTYPES:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_bool(name: str, value: object, *, none_ok: bool = False) -> bool | None:
    """A bool of any kind (Python's, numpy's, a 0-d torch bool tensor) as a Python bool; None too if ``none_ok``.

    numpy's bool is no subclass of bool, and numpy names its type "bool" too: refused, it would read "must be a
    bool, got bool". An int is refused, 0 and 1 included: a flag is set with True or False.
    """
    if isinstance(value, bool) or (none_ok and value is None):
        return value
    if getattr(value, "ndim", None) == 0 and str(getattr(value, "dtype", "")) in _BOOL_DTYPES:
        return bool(value)
    raise TypeError(f"{name} must be {'None or ' if none_ok else ''}a bool, got {type(value).__name__}")


def as_int(name: str, value: object) -> int:
    """An integer of any kind (int, numpy.int64, ...) as a Python int. A bool or a float is refused: True and 1.0
    equal 1, so a request id of either would find request 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {reprlib.repr(value)}")
    return int(value)


def as_seconds(name: str, value: object) -> float:
    """A time in seconds (numpy's numbers too) as a Python float, refused unless finite and >= 0: a clock that
    went back, or a run waiting for an arrival at infinity, would be wrong without a word."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    if not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")
    return float(value)


def _as_float(name: str, value: object) -> float:
    """A real number of any kind (int, float, numpy.float32, ...) as a Python float; bool and NaN are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must be a number, got NaN")
    return value
