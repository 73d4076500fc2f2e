"""Checks for exercise 5, paged attention in torch: one request's attention, read from its blocks.

Each case writes a request's keys and values into a cache of shuffled blocks, fills every other slot
with noise (so reading a slot that is not the request's shows), and compares the learner's output with
dense causal attention over the same keys and values, computed in float32 (one case hands the learner
bfloat16 tensors, as a model served in bfloat16 does).
"""

from __future__ import annotations

from typing import Any

from labkit.exercises.framework import Case, Exercise, Mismatch, property_case, showing

TOLERANCE = 1e-4
#: bfloat16 keeps 8 significant bits (an output between 1 and 2 is a multiple of 1/128); labkit's own
#: paged_attention is within 0.006 of float32 attention on the bfloat16 case.
BF16_TOLERANCE = 3e-2


def scenario(
    num_heads: int, num_kv_heads: int, context_len: int, num_queries: int, block_size: int, seed: int
) -> dict[str, Any]:
    """A paged cache holding one request's context, its block table, and the dense keys/values it stores."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    head_dim, num_blocks = 8, 3 + 2 * -(-context_len // block_size)
    used = -(-context_len // block_size)
    table = torch.randperm(num_blocks, generator=gen)[:used].tolist()
    keys = torch.randn(num_kv_heads, context_len, head_dim, generator=gen)
    values = torch.randn(num_kv_heads, context_len, head_dim, generator=gen)
    key_cache = 3 * torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)  # noise
    value_cache = 3 * torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
    for position in range(context_len):
        block, offset = table[position // block_size], position % block_size
        key_cache[:, block, offset] = keys[:, position]
        value_cache[:, block, offset] = values[:, position]
    query = torch.randn(num_heads, num_queries, head_dim, generator=gen)
    return dict(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=table,
        context_len=context_len,
        keys=keys,
        values=values,
    )


def dense_attention(s: dict[str, Any], scale: float) -> Any:
    """Causal attention over the request's keys and values in position order: what paged attention must equal."""
    import torch.nn.functional as F

    num_heads, num_queries, _ = s["query"].shape
    group = num_heads // s["keys"].shape[0]
    keys, values = s["keys"].repeat_interleave(group, 0), s["values"].repeat_interleave(group, 0)
    import torch

    context = s["context_len"]
    query_pos = torch.arange(context - num_queries, context)[:, None]
    visible = torch.arange(context) <= query_pos
    return F.scaled_dot_product_attention(s["query"], keys, values, attn_mask=visible, scale=scale)


def compare(
    fn: Any,
    hint: str,
    *,
    heads: int,
    kv_heads: int,
    context: int,
    queries: int,
    block_size: int,
    seed: int = 0,
    scale: float = 0.35,
    dtype: str = "float32",
) -> None:
    """Run ``fn`` on a scenario whose tensors are in ``dtype``; Mismatch unless it matches dense attention."""
    import torch

    s = scenario(heads, kv_heads, context, queries, block_size, seed)
    tensors = ("query", "key_cache", "value_cache", "keys", "values")
    s.update({name: s[name].to(getattr(torch, dtype)) for name in tensors})
    expected = dense_attention({**s, **{name: s[name].float() for name in tensors}}, scale)
    tolerance = TOLERANCE if dtype == "float32" else BF16_TOLERANCE
    text = (
        f"query (H={heads}, Q={queries}, D=8); key_cache/value_cache (KV={kv_heads}, blocks={s['key_cache'].shape[1]},"
        f" block_size={block_size}, D=8)\nblock_table={s['block_table']}, context_len={context}, scale={scale}"
        + ("" if dtype == "float32" else f"\nquery, key_cache and value_cache are torch.{dtype}")
    )
    showing(text)
    with torch.no_grad():
        got = fn(
            s["query"].clone(), s["key_cache"].clone(), s["value_cache"].clone(), list(s["block_table"]), context, scale
        )
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise Mismatch(text, f"a tensor of shape {tuple(expected.shape)} (H, Q, D)", f"{shape}", hint)
    if got.dtype != s["query"].dtype:
        want = f"a tensor of the query's dtype, {s['query'].dtype}"
        raise Mismatch(text, want, f"a tensor of dtype {got.dtype}", hint)
    error = (got.float() - expected).abs()
    if not error.max() <= tolerance:
        head, row = divmod(int(error.amax(dim=-1).flatten().argmax()), queries)
        raise Mismatch(
            text,
            f"dense causal attention (float32), within {tolerance:g}: output[{head}, {row}, :4] ="
            f" {_row(expected[head, row])}",
            f"output[{head}, {row}, :4] = {_row(got[head, row])}  (largest difference {error.max().item():.3g})",
            hint,
        )


def _row(values: Any) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values[:4].tolist()) + "]"


def _case(name: str, hint: str, **shape: Any) -> Case:
    return Case(name, lambda fn: compare(fn, hint, **shape), hint)


def _strategy() -> Any:
    from hypothesis import strategies as st

    return st.tuples(
        st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1), (6, 3)]),  # (heads, kv_heads)
        st.integers(1, 40),  # context
        st.integers(1, 6),  # queries (capped at the context)
        st.integers(1, 8),  # block_size
        st.integers(0, 9),  # seed
    )


def _property(fn: Any, example: Any) -> None:
    (heads, kv_heads), context, queries, block_size, seed = example
    compare(
        fn,
        "compare with the dense attention of the same keys and values",
        heads=heads,
        kv_heads=kv_heads,
        context=context,
        queries=min(queries, context),
        block_size=block_size,
        seed=seed,
    )


CONTEXT_HINT = (
    "read exactly the first context_len positions: the request's last block is only partly filled, and"
    " the slots after position context_len - 1 hold someone else's data"
)
CASES = [
    _case(
        "one decode query over whole blocks",
        "gather the request's blocks in block_table order: key_cache[:, block_table] is (KV, blocks, block_size, D);"
        " flatten it to (KV, blocks * block_size, D), then softmax(q @ k^T * scale) @ v",
        heads=2,
        kv_heads=2,
        context=8,
        queries=1,
        block_size=4,
    ),
    _case(
        "a decode query over a context that ends mid-block",
        CONTEXT_HINT,
        heads=2,
        kv_heads=2,
        context=10,
        queries=1,
        block_size=4,
    ),
    _case(
        "blocks are read in block-table order",
        "position p is in block block_table[p // block_size], not in block p // block_size: blocks are not"
        " contiguous, and the table lists them in token order",
        heads=2,
        kv_heads=2,
        context=16,
        queries=1,
        block_size=2,
        seed=3,
    ),
    _case(
        "a prefill chunk attends causally",
        "query q sits at position context_len - Q + q and sees keys 0 .. that position only: mask the later"
        " ones with -inf before the softmax",
        heads=2,
        kv_heads=2,
        context=11,
        queries=5,
        block_size=4,
    ),
    _case(
        "grouped-query attention: query heads share KV heads",
        "with H query heads and KV key/value heads, query head h uses KV head h // (H // KV):"
        " repeat_interleave the KV heads, not repeat",
        heads=4,
        kv_heads=2,
        context=9,
        queries=2,
        block_size=4,
    ),
    _case(
        "the scores are scaled by scale",
        "multiply q @ k^T by scale (given; do not recompute 1/sqrt(D))",
        heads=2,
        kv_heads=1,
        context=6,
        queries=1,
        block_size=4,
        scale=0.9,
    ),
    _case(
        "bfloat16 tensors give a bfloat16 output close to float32 attention",
        "a model served in bfloat16 hands you bfloat16 tensors: compute the softmax in float32"
        " (scores.softmax(dim=-1, dtype=torch.float32)), since in bfloat16 each exponential and their sum keep"
        " only 8 bits of mantissa, and return .to(query.dtype); make every new tensor (the mask, block indices)"
        " with device=query.device, so the same code runs on a GPU",
        heads=4,
        kv_heads=2,
        context=37,
        queries=5,
        block_size=4,
        seed=1,
        dtype="bfloat16",
    ),
    property_case("random shapes match dense attention", _strategy, _property, max_examples=40),
]


def _reference() -> Any:
    from labkit.runtime.attention import paged_attention

    return paged_attention


EXERCISE = Exercise(
    number=5,
    slug="paged_attention",
    title="Paged attention in torch",
    export="paged_attention",
    reference=_reference,
    cases=CASES,
)
