"""Pick each request's next token from its logits: greedy, temperature, top-k, top-p, reproducible seeds.

Seeded sampling is stateless: the random number behind a request's ``n``-th generated token is a hash of
``(seed, n)``, so it does not depend on which other requests share the batch, nor on how often the
request was preempted and recomputed. (A stateful per-request generator would drift as soon as a
recomputation or a batch change made it draw a different number of times.) The number is turned into a
token by inverse-CDF sampling over the filtered distribution, one row per request, all rows at once.
"""

from __future__ import annotations

import random
import reprlib
from collections.abc import Sequence

import torch

from labkit.core.request import SamplingParams, as_token_id

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that depends only on ``(seed, index)`` (splitmix64 mixing)."""
    h = 0x9E3779B97F4A7C15
    for v in (seed, index):
        h = ((h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return (h >> 11) / float(1 << 53)


class Sampler:
    """Samples one token per logits row; requests without a seed draw from this sampler's own RNG."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]) -> list[int]:
        """``logits`` is (rows, vocab); ``indices[i]`` is the output index of the token row ``i`` produces."""
        return self.sample(logits, params, indices).tolist()

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], indices: Sequence[int]) -> torch.Tensor:
        """As calling the sampler, but the tokens stay where the logits are: no wait for the device."""
        if len(params) != logits.shape[0] or len(indices) != logits.shape[0]:
            raise ValueError(f"got {logits.shape[0]} logits rows, {len(params)} params and {len(indices)} indices")
        greedy = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            return greedy
        chosen = [params[i] for i in sampled_rows]
        uniforms = [
            seeded_uniform(p.seed, indices[i]) if p.seed is not None else self.rng.random()
            for i, p in zip(sampled_rows, chosen, strict=True)
        ]
        # One host-to-device copy for every per-row value (float64 holds each of them exactly); on a GPU each
        # copy from Python lists waits for the forward pass, so five separate ones would wait five times.
        # A top_k beyond the vocabulary keeps every token, as 0 does (and stays exact in float64).
        vocab = logits.shape[-1]
        top_ks = [min(p.top_k, vocab) for p in chosen]
        columns = [sampled_rows, [p.temperature for p in chosen], top_ks, [p.top_p for p in chosen]]
        # Pinned, the copy queues behind the forward pass instead of waiting for it (async scheduling).
        values = torch.tensor([*columns, uniforms], dtype=torch.float64, pin_memory=logits.is_cuda)
        values = values.to(logits.device, non_blocking=True)
        rows = values[0].long()
        tokens = self.sample_rows(
            logits[rows].float(),
            temperature=values[1].float(),
            top_k=values[2].long(),
            top_p=values[3].float(),
            uniform=values[4],
        )
        if type(self).sample_rows is not Sampler.sample_rows:  # a learner's (exercise 6): its shape and dtype
            tokens = token_tensor(tokens, len(sampled_rows), greedy.device, "sample_rows")
        greedy[rows] = tokens
        return greedy

    def sample_rows(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """Draw one token per row: scale by temperature, keep the top-k, then the top-p nucleus, then invert the CDF.

        ``logits`` is (rows, vocab) float32; ``temperature`` (> 0), ``top_k`` and ``top_p`` hold one value per
        row, and ``top_k == 0`` and ``top_p == 1`` switch those filters off. ``uniform`` holds one number in
        [0, 1) per row: the row's token is the first one, in order of decreasing probability, whose
        cumulative kept probability exceeds ``uniform`` times the kept mass. Rows are independent and no
        other randomness is drawn, which is what makes a seeded request batch-invariant (exercise 6).
        """
        vocab = logits.shape[-1]
        # A temperature keeps the order. Stable: equal logits stay in vocabulary order, so top_k=1 picks what
        # argmax picks, and a seeded draw among ties is the same token on every device and in every batch.
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
        # Scaled with the largest logit shifted to 0, the others stay <= 0 however small the temperature: they
        # can underflow to probability 0 but never overflow to inf and NaN, so a tiny temperature tends to greedy.
        # The clamp keeps a temperature below float32's range from rounding to 0.
        tiny = torch.finfo(logits.dtype).tiny
        sorted_logits = (sorted_logits - sorted_logits[:, :1]).div_(temperature.clamp(min=tiny)[:, None])
        rank = torch.arange(vocab, device=logits.device)
        keep_k = torch.where(top_k > 0, top_k, vocab)
        sorted_logits = sorted_logits.masked_fill(rank >= keep_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Nucleus: keep the smallest prefix whose mass reaches top_p. The most likely token always stays, as the
        # mass before it is 0: the clamp keeps a top_p below float32's normal range (1e-46, or a subnormal that a
        # flush-to-zero device reads as 0) from becoming 0, which would drop every token.
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p.clamp(min=tiny)[:, None], 0.0)
        cdf = probs.double().cumsum(dim=-1)
        target = (uniform * cdf[:, -1])[:, None]
        index = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
        return sorted_ids.gather(1, index).squeeze(1)


def checked_samples(
    samples: object, vocab_size: int, device: torch.device, request_ids: Sequence[int]
) -> torch.Tensor | list[int]:
    """A plugged-in sampler's tokens, one per row of ``request_ids``, checked; else a TypeError/ValueError naming
    the problem and the row.

    A token outside the vocabulary would fail only in a later step (as an embedding lookup past the table, on a
    GPU a device-side assert that ends the process's CUDA context), with the bad token already in the request.
    A list is checked on the host; a tensor's range costs one wait for the device, which the built-in Sampler,
    trusted, never pays.
    """
    num_rows = len(request_ids)
    if isinstance(samples, torch.Tensor):
        tokens = token_tensor(samples, num_rows, device, "sampler")
        outside = (tokens < 0) | (tokens >= vocab_size)
        if outside.any():
            row = int(outside.nonzero()[0, 0])
            raise _outside(int(tokens[row]), row, request_ids[row], vocab_size)
        return tokens
    if isinstance(samples, (str, bytes)) or not hasattr(samples, "__len__"):
        raise TypeError(f"sampler returned {type(samples).__name__}; expected a list or tensor of token ids")
    if len(samples) != num_rows:
        raise ValueError(f"sampler returned {len(samples)} tokens for {num_rows} rows; expected one token per row")
    checked = []
    for row, sample in enumerate(samples):
        token = as_token_id(sample)
        if token is None:
            what = f"{type(sample).__name__} {reprlib.repr(sample)}"
            raise TypeError(f"sampler returned {what} for row {row} (request {request_ids[row]}); token ids are ints")
        if not 0 <= token < vocab_size:
            raise _outside(token, row, request_ids[row], vocab_size)
        checked.append(token)
    return checked


def token_tensor(tokens: object, num_rows: int, device: torch.device, source: str) -> torch.Tensor:
    """``tokens`` as a (num_rows,) long tensor on ``device``, checked for what needs no wait for the device: a
    tensor (or a list) of integers, one per row; ``source`` names who returned them in the error."""
    if not isinstance(tokens, torch.Tensor):
        try:
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{source} returned {type(tokens).__name__}; expected a tensor of token ids") from None
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"{source} returned tokens of dtype {tokens.dtype}; token ids are integers (torch.long)")
    if tokens.shape != (num_rows,):
        raise ValueError(
            f"{source} returned tokens of shape {tuple(tokens.shape)} for {num_rows} rows; expected one token per"
            f" row, shape ({num_rows},)"
        )
    return tokens.to(device=device, dtype=torch.long)


def _outside(token: int, row: int, request_id: int, vocab_size: int) -> ValueError:
    """The error for a sampled token outside the vocabulary, naming its row and request."""
    return ValueError(
        f"sampler returned token {token} for row {row} (request {request_id}); the vocabulary has {vocab_size}"
        f" tokens, 0 to {vocab_size - 1}"
    )


def feed_back_samples(input_ids: torch.Tensor, samples: torch.Tensor) -> None:
    """Async scheduling: an input id ``-1 - i`` becomes ``samples[i]``, a token the previous step drew, in place.

    The previous step's tokens are still on the device when the next step is launched, so its inputs
    name them by their row; this gathers them there, with no wait for the host to read them.
    """
    rows = torch.bitwise_not(input_ids.view(-1)).clamp_(min=0)  # ~x == -1 - x; a known token's row 0 goes unused
    fed_back = samples.index_select(0, rows).view(input_ids.shape)
    input_ids.copy_(torch.where(input_ids < 0, fed_back, input_ids))
