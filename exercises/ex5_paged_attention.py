"""Exercise 5 · Paged attention in torch: gather one request's keys and values from its blocks, then attend.

The KV cache of one layer is two tensors of shape (KV heads, num_blocks, block_size, D). A request's
tokens are spread over the blocks of its block table, in order but not contiguous. Attention needs its
whole context: gather it, then compute ordinary causal attention for the request's newest tokens.

Check it: ``labkit check``, ``pytest -m ex5 exercises/``, or ``labkit.exercises.check(5)`` in a notebook;
``labkit check 5 --watch`` checks it again each time you save this file.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: Sequence[int],
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one request's newest tokens over its whole context, read from its blocks.

    ``query`` is (H, Q, D): the request's last Q tokens, at positions ``context_len - Q .. context_len - 1``,
    whose keys and values are already in the cache. ``key_cache`` and ``value_cache`` are one layer's
    blocks, (KV, num_blocks, block_size, D); ``block_table`` lists the request's blocks in order
    (it may list more blocks than ``context_len`` fills: a static batch reserves them up front). Query
    ``q`` sees the keys at positions ``0 .. context_len - Q + q`` (causal), scaled by ``scale``; the H
    query heads share the KV heads in groups of H // KV (query head h uses KV head h // (H // KV)).
    Return (H, Q, D), in the query's dtype (``query.dtype``, e.g. bfloat16), on its device. Compute the
    softmax in float32 (``softmax(dim=-1, dtype=torch.float32)``), as labkit does: bfloat16 keeps 8 significant
    bits (7 stored), and a softmax that adds up its exponentials in it loses accuracy (torch's own adds up in
    float32 inside, so the check cannot tell the two apart). Make every tensor you create (the mask, block indices) with
    ``device=query.device``: the same code then runs on a GPU.
    """
    raise NotImplementedError("Exercise 5")
