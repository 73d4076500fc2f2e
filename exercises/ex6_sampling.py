"""Exercise 6 · Sampling: temperature, top-k and top-p, driven by one uniform number per request.

labkit's ``Sampler`` turns each seeded request's ``(seed, n)`` into a uniform number in [0, 1) (a hash,
no shared random state), so a request draws the same tokens alone, in any batch, and after being
preempted and recomputed. Fill in ``sample_rows``: turn logits and that number into a token.

Check it: ``labkit check``, ``pytest -m ex6 exercises/``, or ``labkit.exercises.check(6)`` in a notebook;
``labkit check 6 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

import torch

from labkit.runtime.sampling import Sampler


class MySampler(Sampler):
    def sample_rows(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """Draw one token per row; return a (rows,) tensor of token ids.

        ``logits`` is (rows, vocab) float32; ``temperature`` (> 0), ``top_k`` and ``top_p`` hold one value
        per row. In order: divide the row's logits by its temperature; keep its ``top_k`` most likely tokens
        (``top_k == 0``: all; it is never more than the vocabulary), exactly ``top_k`` of them even when
        several tie with the last one kept (any of those will do); softmax what is left (so top-p sees the
        renormalised probabilities); keep the smallest set of most probable tokens whose mass reaches
        ``top_p``: walking them in decreasing probability, a token is dropped once the mass before it is
        already >= top_p (``top_p == 1``: all). A mass exactly equal to ``top_p`` reaches it: four tokens of
        0.25 with ``top_p = 0.5`` keep two, not three, as in Hugging Face's and vLLM's top-p.
        Then walk the kept tokens, again in decreasing probability (not in vocabulary order; among equal
        probabilities any order will do), and pick the first whose cumulative probability exceeds ``uniform``
        times the kept mass, strictly (inverse CDF; a cumulative probability equal to it picks the next token):
        the same uniform must draw the same token as labkit's sampler. Use
        no other randomness (the checker calls it twice with the same input). You may loop over the rows.
        Make each new tensor on the input's device (``torch.arange(vocab, device=logits.device)``): on a GPU
        the engine hands you CUDA tensors, and mixing them with one made on the CPU raises.
        Greedy requests (temperature 0) never reach ``sample_rows``: ``Sampler.sample`` takes their argmax.
        """
        raise NotImplementedError("Exercise 6")
