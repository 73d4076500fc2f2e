"""Paged attention in plain torch: keys and values live in fixed-size blocks, and each request finds its own
through its block table.

transformers' model code stays untouched: every attention layer calls the function registered under the
model's ``config._attn_implementation`` with the new tokens' (rotary-embedded) queries, keys and values.
labkit registers :func:`paged_attention_forward` under ``"labkit_paged"`` and switches a model to it only
while the runner executes a step (:func:`use_paged_attention`), so ``model.generate`` keeps working on the
same model. The function (1) writes the step's keys and values into their cache slots, then (2) reads
each request's whole context back from its blocks and attends to it.

A step is a packed batch: *segments* (runs of consecutive tokens of one request) concatenated into one
row of T tokens. Everything that depends only on the batch layout - slot mapping, block-id lists,
query positions, masks - is built once per step in a :class:`PagedBatch` and shared by all layers,
which receive it through the keyword arguments transformers forwards to attention functions.

The reference attention batches segments of the same kind: single-token decodes (split in two by
context length when a few long requests would make every short one pad up to them) and multi-token
prefill chunks. It gathers their blocks with one index per block, not per token, and attends with two
batched matrix products around a softmax for decodes and ``scaled_dot_product_attention`` for prefill
chunks. Grouped-query attention needs no copies of K/V: the query heads that share a key/value head
are folded into extra query rows of that head.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "labkit_paged"


class PagedKVCache:
    """K and V of every layer, in blocks: a (layers, 2, kv_heads, num_blocks + 1, block_size, head_dim) tensor.

    Heads come before blocks so that gathering a request's blocks yields, per head, its context as one
    contiguous (tokens, head_dim) matrix, ready for the attention matmuls without further copies.
    Block ``num_blocks`` (the last one) is scratch that the allocator never hands out: rows computed only
    to keep a static batch's shape write their keys and values there. Zero-initialised, so that a masked
    slot never holds NaN (0 * NaN would leak into the output).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(
            (num_layers, 2, num_kv_heads, num_blocks + 1, block_size, head_dim), dtype=dtype, device=device
        )
        # Per layer: K and V blocks, and the same as (kv_heads, slots, head_dim) for writing.
        self.parts = [self.data[i].unbind(0) for i in range(num_layers)]
        self.slots = [tuple(part.view(num_kv_heads, -1, head_dim) for part in parts) for parts in self.parts]
        # Gathers reuse one buffer: a fresh multi-megabyte tensor per layer would cost a page fault per 4 KiB.
        self.workspace: torch.Tensor | None = None

    @property
    def scratch_slot(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Memory one block takes across all layers (K and V): what sizing the cache from memory divides by."""
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key`` and ``value`` (kv_heads, tokens, head_dim) of ``layer`` into cache slots ``slots``."""
        key_slots, value_slots = self.slots[layer]
        key_slots.index_copy_(1, slots, key)
        value_slots.index_copy_(1, slots, value)

    def buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable (kv_heads, num_blocks, block_size, head_dim) buffers that gathered keys and values go to."""
        _, _, num_kv_heads, _, block_size, head_dim = self.data.shape
        size = num_kv_heads * num_blocks * block_size * head_dim
        if self.workspace is None or self.workspace.shape[1] < size:
            self.workspace = torch.empty((2, size), dtype=self.data.dtype, device=self.data.device)
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        return self.workspace[0, :size].view(shape), self.workspace[1, :size].view(shape)

    def gather(self, layer: int, part: int, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy blocks ``block_ids`` of ``layer``'s keys (``part=0``) or values (``part=1``) into ``out``.

        Returns ``out`` as (kv_heads, len(block_ids) * block_size, head_dim). Keys and values are gathered
        separately, each just before it is used, so that the copy is still in the CPU cache when the
        matrix product reads it.
        """
        torch.index_select(self.parts[layer][part], 1, block_ids, out=out)
        return out.view(out.shape[0], -1, out.shape[-1])


class Segment(NamedTuple):
    """``num_tokens`` tokens of one request at positions ``start..``, and where its context lives.

    ``block_table`` lists the request's blocks. A padding segment (``writes_cache=False``) writes its
    keys and values to the scratch slot and attends only to the request's cached positions ``[0, start)``.
    """

    start: int
    num_tokens: int
    block_table: Sequence[int]
    writes_cache: bool = True


@dataclass
class AttentionGroup:
    """``S`` segments attended together as one padded batch of ``S x Q`` query rows over ``B`` blocks each.

    Index tensors are flat, for ``index_select``/``index_copy_`` (much faster than advanced indexing).
    ``query_rows[s * Q + q]`` is the packed row of segment ``s``'s ``q``-th token; rows past a segment's
    end repeat its last token, so that no row is fully masked. ``valid`` picks the real ones (None when
    all are real) and ``output_rows`` says where their results go. Both are None when the group is the
    whole batch in packed order (a pure decode step, or a lone prefill chunk): then no copy is needed.
    ``block_ids[s * B + b]`` is segment ``s``'s ``b``-th block (padded with block 0, which the mask hides).
    """

    num_segments: int
    num_queries: int
    num_blocks: int
    query_rows: torch.Tensor | None
    output_rows: torch.Tensor | None
    valid: torch.Tensor | None
    block_ids: torch.Tensor
    last_key: torch.Tensor  # (S, Q): the last context position each query row may see
    buffers: tuple[torch.Tensor, torch.Tensor]  # where this group's keys and values are gathered to
    masks: dict[tuple[int, int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(
        self, block_size: int, num_kv_heads: int, per_kv: int, sliding_window: int | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """Additive mask, 0 where a query row may see a cached key and -inf elsewhere; built once per step.

        ``per_kv`` is the number of query heads per KV head. Shapes: (KV * S, 1, keys) for decode rows,
        broadcast over the heads that share a KV head; (1, S, per_kv * Q, keys) for prefill chunks.
        """
        key = (num_kv_heads, per_kv, sliding_window, dtype)
        if key not in self.masks:
            key_pos = torch.arange(self.num_blocks * block_size, device=self.last_key.device)
            last_key = self.last_key[:, :, None]
            allowed = key_pos <= last_key
            if sliding_window is not None:
                allowed &= key_pos > last_key - sliding_window
            if self.num_queries == 1:
                allowed = allowed.expand(num_kv_heads, -1, -1, -1).reshape(-1, 1, key_pos.numel())
            else:  # rows are (head, query) pairs: repeat the query rows per head
                shape = (self.num_segments, per_kv, self.num_queries, key_pos.numel())
                allowed = allowed[None, :, None].expand(1, *shape).reshape(1, self.num_segments, -1, shape[-1])
            mask = torch.full(allowed.shape, float("-inf"), dtype=dtype, device=allowed.device)
            self.masks[key] = mask.masked_fill_(allowed, 0.0)
        return self.masks[key]


@dataclass
class PagedBatch:
    """One step's layout, built once and read by every layer: where to write K/V, what each query attends to."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # (T,) long: the cache slot each packed token writes its K/V to
    position_ids: torch.Tensor  # (T,) long
    groups: list[AttentionGroup]


def build_paged_batch(cache: PagedKVCache, segments: Sequence[Segment], device: torch.device) -> PagedBatch:
    """Turn a step's segments into the index tensors attention needs.

    Python work is one pass over the segments, one run of slots per block touched and one block id per
    context block: it grows with the tokens computed and the blocks read, never per cached token.
    """
    block_size = cache.block_size
    positions: list[int] = []
    slots: list[int] = []
    decodes: list[tuple[int, Segment]] = []  # (first packed row, segment)
    prefills: list[tuple[int, Segment]] = []
    for segment in segments:
        start, num_tokens, table, writes_cache = segment
        (decodes if num_tokens == 1 else prefills).append((len(positions), segment))
        end = start + num_tokens
        positions.extend(range(start, end))
        if not writes_cache:
            slots.extend([cache.scratch_slot] * num_tokens)
            continue
        position = start
        while position < end:  # one run of consecutive slots per block
            block, offset = divmod(position, block_size)
            run = min(block_size - offset, end - position)
            first = table[block] * block_size + offset
            slots.extend(range(first, first + run))
            position += run
    num_rows = len(positions)
    parts = [*_split_by_context(decodes, block_size), prefills]
    groups = [_group(cache, members, num_rows, device) for members in parts if members]
    return PagedBatch(
        cache=cache,
        slot_mapping=torch.tensor(slots, device=device),
        position_ids=torch.tensor(positions, device=device),
        groups=groups,
    )


def _context_blocks(segment: Segment, block_size: int) -> int:
    context = segment.start + segment.num_tokens if segment.writes_cache else segment.start
    return -(-context // block_size)


def _split_by_context(decodes: list[tuple[int, Segment]], block_size: int) -> list[list[tuple[int, Segment]]]:
    """Split decode rows into short- and long-context halves when that saves a quarter of the padded blocks.

    A padded group reads every segment's context up to the longest one's length; a few long requests
    among many short ones would multiply the keys and values copied for attention.
    """
    if len(decodes) < 2:
        return [decodes]
    members = sorted(decodes, key=lambda member: _context_blocks(member[1], block_size))
    blocks = [_context_blocks(segment, block_size) for _, segment in members]
    padded, split = min((i * blocks[i - 1] + (len(blocks) - i) * blocks[-1], i) for i in range(1, len(blocks)))
    if padded > 0.75 * len(blocks) * blocks[-1]:
        return [decodes]
    return [members[:split], members[split:]]


def _group(
    cache: PagedKVCache, members: list[tuple[int, Segment]], num_rows: int, device: torch.device
) -> AttentionGroup:
    block_size = cache.block_size
    lengths = [s.num_tokens for _, s in members]
    contexts = [s.start + s.num_tokens if s.writes_cache else s.start for _, s in members]
    num_queries = max(lengths)
    num_blocks = -(-max(contexts) // block_size)
    block_ids: list[int] = []
    for (_, segment), context in zip(members, contexts, strict=True):
        blocks = list(segment.block_table[: -(-context // block_size)])
        block_ids += blocks + [0] * (num_blocks - len(blocks))

    if num_queries == 1:  # decode rows: one query row per segment, nothing padded
        query_rows = torch.tensor([row for row, _ in members])
        last_key = torch.tensor([[min(s.start, c - 1)] for (_, s), c in zip(members, contexts, strict=True)])
        valid = None
    else:  # query row q of a segment is its token min(q, length - 1): rows past the end repeat the last token
        length = torch.tensor(lengths)[:, None]
        offsets = torch.arange(num_queries)
        last = torch.minimum(offsets, length - 1)
        query_rows = (torch.tensor([row for row, _ in members])[:, None] + last).flatten()
        starts = torch.tensor([s.start for _, s in members])[:, None]
        last_key = torch.minimum(starts + last, torch.tensor(contexts)[:, None] - 1)  # causal, within the context
        valid = None if min(lengths) == num_queries else torch.nonzero((offsets < length).flatten()).flatten()
    # Segments sit in packed order, so a group holding every row, unpadded, holds them in order.
    in_order = valid is None and len(members) * num_queries == num_rows
    output_rows = query_rows if valid is None else query_rows[valid]
    return AttentionGroup(
        num_segments=len(members),
        num_queries=num_queries,
        num_blocks=num_blocks,
        query_rows=None if in_order else query_rows.to(device),
        output_rows=None if in_order else output_rows.to(device),
        valid=None if valid is None else valid.to(device),
        block_ids=torch.tensor(block_ids, device=device),
        last_key=last_key.to(device),
        buffers=cache.buffers(len(block_ids)),
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    paged_batch: PagedBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer of a packed step; query (1, H, T, D), key/value (1, KV, T, D) -> (1, T, H, D).

    Writes the step's keys and values into the cache, then attends from the cache only.
    """
    if paged_batch is None:
        raise ValueError(f"the {ATTENTION_NAME!r} attention runs inside labkit's ModelRunner, which passes paged_batch")
    _, num_heads, _, head_dim = query.shape
    num_kv_heads = key.shape[1]
    per_kv = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    cache, layer = paged_batch.cache, module.layer_idx
    cache.write(layer, paged_batch.slot_mapping, key[0], value[0])

    tokens = query[0].transpose(0, 1)  # (T, H, D)
    output = None
    for group in paged_batch.groups:
        segments, rows = group.num_segments, group.num_queries
        context = group.num_blocks * cache.block_size
        mask = group.mask(cache.block_size, num_kv_heads, per_kv, sliding_window, query.dtype)
        q = tokens if group.query_rows is None else tokens.index_select(0, group.query_rows)
        # Query heads that share a KV head become extra query rows of that head: (KV, S, per_kv * Q, D).
        q = q.reshape(segments, rows, num_kv_heads, per_kv, head_dim).permute(2, 0, 3, 1, 4)
        q = q.reshape(num_kv_heads, segments, per_kv * rows, head_dim)
        if rows == 1:  # decode: per request and KV head, two thin matrix products around a softmax
            keys = cache.gather(layer, 0, group.block_ids, group.buffers[0]).view(-1, context, head_dim)
            scores = torch.baddbmm(mask, q.reshape(-1, per_kv, head_dim), keys.transpose(1, 2), alpha=scale)
            probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
            values = cache.gather(layer, 1, group.block_ids, group.buffers[1]).view(-1, context, head_dim)
            out = torch.bmm(probs, values)
        else:  # prefill chunks: the fused kernel never materialises the (queries x context) scores
            k = cache.gather(layer, 0, group.block_ids, group.buffers[0]).view(num_kv_heads, segments, context, -1)
            v = cache.gather(layer, 1, group.block_ids, group.buffers[1]).view(num_kv_heads, segments, context, -1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        # Back to one row per token: (S * Q, H, D).
        out = out.view(num_kv_heads, segments, per_kv, rows, head_dim).permute(1, 3, 0, 2, 4)
        out = out.reshape(segments * rows, num_heads, head_dim)
        if group.output_rows is None:
            output = out
            break
        if group.valid is not None:
            out = out.index_select(0, group.valid)
        if output is None:
            output = tokens.new_empty(tokens.shape)
        output.index_copy_(0, group.output_rows, out)
    return output.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextmanager
def use_paged_attention(model: torch.nn.Module) -> Iterator[None]:
    """Route ``model``'s attention layers to labkit's paged attention inside the block, then restore.

    transformers builds no attention mask for an implementation it has no mask function for, so no
    T x T mask is created: the PagedBatch carries the masks.
    """
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
