"""Checks for exercise 5, paged attention in torch: one request's attention, read from its blocks.

Each case writes a request's keys and values into a cache of shuffled blocks, fills every other slot
with noise of the same size (so reading a slot that is not the request's shows, while bfloat16 rounds a
wrong output no more than a right one; one case's table also lists blocks reserved past the context, as a
static batch's does), and compares the learner's output with dense causal attention over
the same keys and values, computed in float32 (one case hands the learner bfloat16 tensors, as a model
served in bfloat16 does, and one hands them over on the GPU, where there is one). A wrong output is compared
with what each classic mistake would give (:data:`MISTAKES`): one bug breaks several cases, and each of them
then names that bug, and only it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from labkit.core.blocks import blocks_for
from labkit.exercises.framework import Case, Exercise, Mismatch, property_case, showing

TOLERANCE = 1e-4
#: bfloat16 keeps 8 significant bits (an output between 1 and 2 is a multiple of 1/128); labkit's own
#: paged_attention is within 0.0025 of float32 attention on the bfloat16 case.
BF16_TOLERANCE = 3e-2
#: The cases' scale: far from 1/sqrt(8) = 0.354, so that an implementation which recomputes the scale fails.
SCALE = 0.25


def scenario(
    num_heads: int,
    num_kv_heads: int,
    context_len: int,
    num_queries: int,
    block_size: int,
    seed: int,
    reserved_blocks: int = 0,
) -> dict[str, Any]:
    """A paged cache holding one request's context, its block table, and the dense keys/values it stores.

    ``reserved_blocks`` more blocks end the table, past the context: reserved ahead, holding only noise.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    head_dim, num_blocks = 8, 3 + 2 * blocks_for(context_len, block_size) + reserved_blocks
    used = blocks_for(context_len, block_size)
    table = torch.randperm(num_blocks, generator=gen)[: used + reserved_blocks].tolist()
    keys = torch.randn(num_kv_heads, context_len, head_dim, generator=gen)
    values = torch.randn(num_kv_heads, context_len, head_dim, generator=gen)
    key_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)  # noise
    value_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
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


def dense_attention(
    s: dict[str, Any],
    scale: float,
    *,
    kv_head: Any = None,
    sees: int = 0,
    causal: bool = True,
    softmax_dim: int = -1,
    shifted: bool = True,
) -> Any:
    """Causal attention over the request's keys and values in position order: what paged attention must equal.

    The keywords exist to replay a classic mistake (:data:`MISTAKES`) on the same arithmetic; their defaults
    are the contract: query head h reads KV head ``kv_head[h]`` = h // (H // KV), query q sees the keys up to
    its own position plus ``sees``, and the softmax normalises over the keys, shifted by their largest score
    (``shifted=False`` exponentiates the scores as they are, which overflows to inf above 88 in float32).
    """
    import torch

    query, keys, values = s["query"], s["keys"], s["values"]
    num_heads, num_queries, _ = query.shape
    if kv_head is None:
        kv_head = torch.arange(num_heads) // (num_heads // keys.shape[0])
    scores = query @ keys[kv_head].transpose(1, 2) * scale
    if causal:
        context = s["context_len"]
        query_pos = torch.arange(context - num_queries, context)[:, None] + sees
        scores = scores.masked_fill(torch.arange(keys.shape[1]) > query_pos, float("-inf"))
    if not shifted:
        exponentials = scores.exp()
        return exponentials / exponentials.sum(dim=softmax_dim, keepdim=True) @ values[kv_head]
    return scores.softmax(dim=softmax_dim) @ values[kv_head]


def gather(s: dict[str, Any], table: Sequence[int], length: int) -> dict[str, Any]:
    """The keys and values found by reading positions 0 .. length - 1 through ``table``, as dense ones.

    A mistake in reading the cache is replayed as dense attention over what it reads. IndexError when the
    table has no block for position length - 1: that mistake cannot be made on this input.
    """
    block_size = s["key_cache"].shape[2]
    if length > len(table) * block_size:
        raise IndexError(f"position {length - 1} is past the table's {len(table)} blocks")
    blocks = list(table)[: blocks_for(length, block_size)]
    keys = s["key_cache"][:, blocks].flatten(1, 2)[:, :length]
    return dict(keys=keys, values=s["value_cache"][:, blocks].flatten(1, 2)[:, :length], context_len=length)


class Mistake(NamedTuple):
    """A classic mistake, named in a hint as "your output is what <does> would give: <fix>".

    ``replay(s, scale)`` is the output the mistake gives on a case's float32 inputs.
    """

    does: str
    fix: str
    replay: Callable[[dict[str, Any], float], Any]


def _reading(
    table: Callable[[Sequence[int]], Sequence[int]], length: Callable[[dict[str, Any]], int]
) -> Callable[[dict[str, Any], float], Any]:
    """The replay of a mistake in reading the cache: ``length(s)`` positions read through ``table(block_table)``."""
    return lambda s, scale: dense_attention({**s, **gather(s, table(s["block_table"]), length(s))}, scale)


def _context(s: dict[str, Any]) -> int:
    return s["context_len"]


def _context_blocks(s: dict[str, Any]) -> int:
    """The positions in the blocks that hold the context: every slot of its last block included."""
    block_size = s["key_cache"].shape[2]
    return blocks_for(s["context_len"], block_size) * block_size


def _whole_table(s: dict[str, Any]) -> int:
    """The positions in every block of the table; IndexError when the table has no block past the context, where
    reading it all is reading every slot of the last block (a mistake of its own)."""
    positions = len(s["block_table"]) * s["key_cache"].shape[2]
    if positions == _context_blocks(s):
        raise IndexError("the table has no block past the context")
    return positions


def _head_dim(s: dict[str, Any]) -> int:
    return s["query"].shape[-1]


def _modulo_heads(s: dict[str, Any], scale: float) -> Any:
    import torch

    return dense_attention(s, scale, kv_head=torch.arange(s["query"].shape[0]) % s["keys"].shape[0])


MISTAKES = [
    Mistake(
        "reading blocks 0, 1, 2, ... in place of the block table's",
        "look each block up in block_table; the allocator hands out whichever blocks are free",
        _reading(lambda table: range(len(table)), _context),
    ),
    Mistake(
        "reading the blocks in sorted order (sorted(block_table))",
        "read them in block_table's own order, which is token order, not block-id order",
        _reading(sorted, _context),
    ),
    Mistake(
        "reading every slot of the last block (context_len ignored)",
        "keep the first context_len positions; the rest of the last block holds no token of this request",
        _reading(list, _context_blocks),
    ),
    Mistake(
        "reading every block of block_table (len(block_table) * block_size positions, context_len ignored)",
        "block_table may end with blocks reserved ahead, past the context: read its first"
        " ceil(context_len / block_size) blocks and keep the first context_len positions",
        _reading(list, _whole_table),
    ),
    Mistake(
        "reading context_len + 1 positions",
        "positions run 0 .. context_len - 1; the slot after them holds no token of this request",
        _reading(list, lambda s: s["context_len"] + 1),
    ),
    Mistake(
        "query head h reading KV head h % KV (repeat in place of repeat_interleave)",
        "query heads share KV heads in consecutive groups, so head h uses KV head h // (H // KV)",
        _modulo_heads,
    ),
    Mistake(
        "scaling by 1/sqrt(D) = {rsqrt:.3f} in place of scale = {scale:g}",
        "multiply by the scale argument; the model chooses it, and it need not be 1/sqrt(D)",
        lambda s, scale: dense_attention(s, _head_dim(s) ** -0.5),
    ),
    Mistake(
        "unscaled scores (q @ k^T without scale)",
        "multiply the scores by scale before the softmax",
        lambda s, scale: dense_attention(s, 1.0),
    ),
    Mistake(
        "scaling twice, by scale and by 1/sqrt(D) (F.scaled_dot_product_attention without scale= applies 1/sqrt(D))",
        "scale the scores once: pass scale=scale to F.scaled_dot_product_attention, or multiply by it yourself",
        lambda s, scale: dense_attention(s, scale * _head_dim(s) ** -0.5),
    ),
    Mistake(
        "a causal mask that hides each query's own position (< where <= belongs)",
        "keep each key whose position is <= the query's: a token attends to itself too",
        lambda s, scale: dense_attention(s, scale, sees=-1),
    ),
    Mistake(
        "a causal mask one position late (each query also sees the next token's key)",
        "keep each key whose position is <= the query's, not one more: a prefill chunk must give what decoding"
        " one token at a time gives, when the next token does not exist yet",
        lambda s, scale: dense_attention(s, scale, sees=1),
    ),
    Mistake(
        "a causal mask aligned to the top left: query i sees keys 0 .. i (F.scaled_dot_product_attention's"
        " is_causal=True, or torch.tril(ones(Q, K)), when there are fewer queries than keys)",
        "the queries are the last Q positions of the context: query i sits at position context_len - Q + i and sees"
        " the keys up to there; build that mask yourself (and pass it as attn_mask=)",
        lambda s, scale: dense_attention(s, scale, sees=s["query"].shape[1] - s["context_len"]),
    ),
    Mistake(
        "no causal mask",
        "in a prefill chunk a query must not see the keys of the tokens after it; set their scores to -inf",
        lambda s, scale: dense_attention(s, scale, causal=False),
    ),
    Mistake(
        "a softmax that exponentiates the scores without subtracting each row's largest first (exp of a score"
        " above about 88 is inf in float32, and inf / inf is NaN)",
        "subtract each row's largest score before exp, scores - scores.amax(dim=-1, keepdim=True), which changes"
        " nothing else; scores.softmax(dim=-1) does it for you",
        lambda s, scale: dense_attention(s, scale, shifted=False),
    ),
    Mistake(
        "a softmax over dim 1 (the queries)",
        "normalise each query's scores over the keys, softmax(dim=-1)",
        lambda s, scale: dense_attention(s, scale, softmax_dim=1),
    ),
    Mistake(
        "a softmax over dim 0 (the heads)",
        "normalise each query's scores over the keys, softmax(dim=-1)",
        lambda s, scale: dense_attention(s, scale, softmax_dim=0),
    ),
]


def diagnose(s: dict[str, Any], scale: float, got: Any, expected: Any, tolerance: float) -> str:
    """Name the classic mistakes whose replay on this case's float32 inputs ``s`` gives the learner's output.

    A replay that cannot run on these inputs (reading past the table's last block, or reading the whole of a
    table that ends with the context) is skipped, since an error there is labkit's, not the learner's; one that
    gives the right answer here cannot be what broke.
    """
    found = []
    for mistake in MISTAKES:
        try:
            would_give = mistake.replay(s, scale)
        except IndexError:
            continue
        if not _close(would_give, expected, tolerance) and _close(got, would_give, tolerance):
            found.append(mistake)
    if not found:
        return ""
    does = " or ".join(m.does.format(scale=scale, rsqrt=_head_dim(s) ** -0.5) for m in found)
    fixes = "; ".join(dict.fromkeys(m.fix for m in found))
    return f"Your output is what {does} would give: {fixes}"


def _close(a: Any, b: Any, tolerance: float) -> bool:
    """Equal within ``tolerance``, NaN where the other is NaN (a query that sees no key gets NaN)."""
    import torch

    return torch.allclose(a.float(), b.float(), rtol=0, atol=tolerance, equal_nan=True)


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
    scale: float = SCALE,
    dtype: str = "float32",
    reserved_blocks: int = 0,
    device: str = "cpu",
    values: bool = True,
) -> None:
    """Run ``fn`` on a scenario whose tensors are in ``dtype`` on ``device``; Mismatch unless it comes back on
    ``device`` and (with ``values``) matches dense attention, computed on the CPU.

    A mismatch names the classic mistakes that would give the learner's output (:func:`diagnose`) in place of
    the case's hint: one bug breaks several cases, and each case's own hint (about the scale, GQA, block order)
    would read as a second bug. On a bfloat16 input, a function that is wrong in float32 too is told so.
    """
    import torch

    from labkit.exercises.meta_device import META_NOTE

    s = scenario(heads, kv_heads, context, queries, block_size, seed, reserved_blocks)
    tensors = ("query", "key_cache", "value_cache", "keys", "values")
    s.update({name: s[name].to(getattr(torch, dtype)) for name in tensors})
    exact = {**s, **{name: s[name].float() for name in tensors}}
    handed = {name: s[name].to(device) for name in ("query", "key_cache", "value_cache")}
    expected = dense_attention(exact, scale)
    tolerance = TOLERANCE if dtype == "float32" else BF16_TOLERANCE
    text = (
        f"query (H={heads}, Q={queries}, D=8); key_cache/value_cache (KV={kv_heads}, blocks={s['key_cache'].shape[1]},"
        f" block_size={block_size}, D=8)\nblock_table={s['block_table']}, context_len={context}, scale={scale}"
        + ("" if dtype == "float32" else f"\nquery, key_cache and value_cache are torch.{dtype}")
        + (
            f"\nthe table's last {reserved_blocks} blocks are reserved ahead, past the context"
            if reserved_blocks
            else ""
        )
        + ("" if device == "cpu" else f"\nquery, key_cache and value_cache are on {device}")
        + ("" if device != "meta" else f", {META_NOTE}")
    )
    showing(text)
    with torch.no_grad():
        got = fn(
            handed["query"].clone(),
            handed["key_cache"].clone(),
            handed["value_cache"].clone(),
            list(s["block_table"]),
            context,
            scale,
        )
    want = f"a tensor of shape {tuple(expected.shape)} (H, Q, D)"
    if not isinstance(got, torch.Tensor):
        returned = "None" if got is None else f"a {type(got).__name__}"
        raise Mismatch(text, want, returned, RETURN_HINT.format(returned=returned))
    if tuple(got.shape) != tuple(expected.shape):
        raise Mismatch(text, want, f"{tuple(got.shape)}", hint)
    if got.device != handed["query"].device:
        want = f"a tensor on the query's device, {handed['query'].device}"
        raise Mismatch(text, want, f"a tensor on {got.device}", DEVICE_HINT)
    if not values:
        return
    got = got.cpu()
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
            diagnose(exact, scale, got, expected, tolerance)
            or (dtype != "float32" and _float32_too(fn, exact, scale, expected))
            or hint,
        )


def _float32_too(fn: Any, exact: dict[str, Any], scale: float, expected: Any) -> str:
    """For a bfloat16 case: a hint when ``fn`` is wrong on the same inputs in float32 too (not the dtype's bug)."""
    import torch

    try:
        with torch.no_grad():
            got = fn(
                exact["query"].clone(),
                exact["key_cache"].clone(),
                exact["value_cache"].clone(),
                list(exact["block_table"]),
                exact["context_len"],
                scale,
            )
    except Exception:  # only a probe: the case reports the bfloat16 run
        return ""
    if isinstance(got, torch.Tensor) and got.shape == expected.shape and _close(got, expected, TOLERANCE):
        return ""
    return (
        "your function is wrong on these inputs in float32 too, so the bug is not in how it handles bfloat16:"
        " the float32 cases point at it"
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
        "reproduce it in a notebook: from labkit.exercises.ex5_paged_attention import dense_attention, scenario;"
        f" s = scenario(num_heads={heads}, num_kv_heads={kv_heads}, context_len={context},"
        f" num_queries={min(queries, context)}, block_size={block_size}, seed={seed}); compare"
        f" paged_attention(s['query'], s['key_cache'], s['value_cache'], s['block_table'], {context}, {SCALE})"
        f" with dense_attention(s, {SCALE}), which holds the same keys and values in position order",
        heads=heads,
        kv_heads=kv_heads,
        context=context,
        queries=min(queries, context),
        block_size=block_size,
        seed=seed,
    )


RETURN_HINT = (
    "return the output tensor, (H, Q, D) in the query's dtype, not {returned} (a function that ends without a"
    " return statement returns None)"
)
DEVICE_HINT = (
    "return the output on the query's device (query.device) and make every tensor you create there (the mask,"
    " block indices: torch.arange(..., device=query.device)): on a GPU the cache and the queries live in GPU"
    " memory, and a tensor on another device either raises or has to be copied each step"
)


# The bfloat16 case's shape; the device case hands over the same inputs.
BF16_CASE: dict[str, Any] = dict(heads=4, kv_heads=2, context=37, queries=5, block_size=4, seed=1, dtype="bfloat16")


def _on_device(fn: Any) -> None:
    """The bfloat16 case's inputs on the GPU where there is one, checked in full. On a machine without one the
    function runs on the CPU first, so that a stub or its own error is reported as itself (its values are the
    bfloat16 case's), then on torch's meta device standing in for a GPU, where a tensor it makes without
    ``device=query.device`` raises as on a GPU (:func:`labkit.exercises.meta_device.run_on_meta`) and the output
    must come back on meta."""
    import torch

    if torch.cuda.is_available():
        compare(fn, DEVICE_HINT, **BF16_CASE, device="cuda")
        return
    from labkit.exercises.meta_device import run_on_meta

    compare(fn, DEVICE_HINT, **BF16_CASE, values=False)
    run_on_meta(lambda: compare(fn, DEVICE_HINT, **BF16_CASE, device="meta", values=False))


# The large-scores case: a scale of 40 makes scores of a few hundred (q . k is about +-3 for D=8), and a softmax
# that does not subtract the largest score overflows, as one can on a model's real activations.
LARGE_SCORES_CASE: dict[str, Any] = dict(heads=2, kv_heads=2, context=9, queries=3, block_size=4, scale=40.0)
LARGE_SCORES_HINT = (
    "the scores here reach a few hundred, and exp of one above about 88 overflows float32 (inf, and inf / inf"
    " is NaN): subtract each row's largest score before exp, or use scores.softmax(dim=-1), which does. An"
    " output that is finite but wrong here is wrong in the cases above too, whose hints say more"
)
CONTEXT_HINT = (
    "read exactly the first context_len positions: the request's last block is only partly filled, and"
    " the slots after position context_len - 1 are not written yet and hold stale keys from an earlier owner"
)
RESERVED_HINT = (
    "block_table may list more blocks than the context fills (a static batch reserves its blocks up front):"
    " read its first ceil(context_len / block_size) blocks and keep the first context_len positions; the blocks"
    " after them hold no token of this request yet"
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
        "a block table reserved ahead lists blocks past the context",
        RESERVED_HINT,
        heads=2,
        kv_heads=2,
        context=10,
        queries=1,
        block_size=4,
        seed=2,
        reserved_blocks=2,
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
        **BF16_CASE,
    ),
    _case("large scores: the softmax stays finite", LARGE_SCORES_HINT, **LARGE_SCORES_CASE),
    Case("the output stays on the query's device (a GPU's, or without one, meta)", _on_device, DEVICE_HINT),
    property_case("random shapes match dense attention", _strategy, _property, max_examples=40),
]


def _reference() -> Any:
    from labkit.runtime.attention import paged_attention

    return paged_attention


EXERCISE = Exercise(
    number=5,
    after=("03",),
    slug="paged_attention",
    title="Paged attention in torch",
    export="paged_attention",
    reference=_reference,
    cases=CASES,
)
