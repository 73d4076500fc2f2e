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

The reference attention batches segments of the same kind, and each kind reads only what it needs:

* single-token decodes (split in two by context length when a few long requests would make every short
  one pad up to them): scores by one batched matrix product over keys gathered block by block; output
  as a probability-weighted sum of value rows that ``embedding_bag`` reads straight from the cache;
* prompt chunks with nothing cached before them: causal ``scaled_dot_product_attention`` over their own
  keys and values, which the layer already holds - no cache read, no mask;
* other multi-token chunks (a prompt's later chunks, a first chunk after a prefix-cache hit, a static
  batch's padding rows):
  ``scaled_dot_product_attention`` over keys and values gathered from their blocks, with a mask.

Grouped-query attention needs no copies of K/V: the query heads that share a key/value head are folded
into extra query rows of that head. On a CPU a decode step moves little data and computes little, so its
time goes to the number of torch calls and to reading the cache: the code below keeps both small.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from labkit.core.blocks import blocks_for

ATTENTION_NAME = "labkit_paged"

# Splitting decode rows into two groups costs a second pass through the attention calls (tens of
# microseconds on a CPU); it must save at least this many padded blocks to pay for itself.
MIN_SPLIT_SAVING_BLOCKS = 32


def long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` for a list of Python ints, several times faster.

    ``torch.tensor`` inspects the ints one by one; ``array("q")`` packs them in C and ``torch.frombuffer``
    wraps that memory without a copy. Every step turns its index lists into tensors, so this adds up.
    """
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    tensor = torch.frombuffer(array("q", values), dtype=torch.long)
    return tensor if device.type == "cpu" else tensor.to(device)


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
        self.num_kv_heads = num_kv_heads
        self.data = torch.zeros(
            (num_layers, 2, num_kv_heads, num_blocks + 1, block_size, head_dim), dtype=dtype, device=device
        )
        # Per layer: K and V blocks, and the same as (1, kv_heads, slots, head_dim) for writing the
        # attention layer's (1, kv_heads, tokens, head_dim) keys and values as they come.
        self.parts = [self.data[i].unbind(0) for i in range(num_layers)]
        self.slots = [tuple(part.view(1, num_kv_heads, -1, head_dim) for part in parts) for parts in self.parts]
        # Per layer: V as one table of (kv_heads * slots) rows, which decode attention sums by index. Slot i
        # of the block starting at slot b is row b + row_offsets[kv, 0, 0, i] in KV head kv.
        self.value_rows = [self.data[i, 1].view(-1, head_dim) for i in range(num_layers)]
        slots_per_head = (num_blocks + 1) * block_size
        heads = torch.arange(num_kv_heads, device=device).view(-1, 1, 1, 1)
        self.row_offsets = heads * slots_per_head + torch.arange(block_size, device=device)
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
        """Store ``key`` and ``value`` (1, kv_heads, tokens, head_dim) of ``layer`` into cache slots ``slots``."""
        key_slots, value_slots = self.slots[layer]
        key_slots.index_copy_(2, slots, key)
        value_slots.index_copy_(2, slots, value)

    def buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable (kv_heads, num_blocks, block_size, head_dim) buffers that gathered keys and values go to."""
        _, _, num_kv_heads, _, block_size, head_dim = self.data.shape
        size = num_kv_heads * num_blocks * block_size * head_dim
        if self.workspace is None or self.workspace.shape[1] < size:
            self.workspace = torch.empty((2, size), dtype=self.data.dtype, device=self.data.device)
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        return self.workspace[0, :size].view(shape), self.workspace[1, :size].view(shape)

    def gather(self, layer: int, part: int, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy blocks ``block_ids`` of ``layer``'s keys (``part=0``) or values (``part=1``) into ``out``; return it.

        ``out`` is (kv_heads, len(block_ids), block_size, head_dim). Keys and values are gathered
        separately, each just before it is used, so that the copy is still in the CPU cache when the
        matrix product reads it.
        """
        return torch.index_select(self.parts[layer][part], 1, block_ids, out=out)


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
class DecodeGroup:
    """``S`` single-token segments attended together: one query row each, contexts padded to ``B`` blocks.

    ``query_rows[s]`` is segment ``s``'s packed row (None when the group is the whole step, in packed
    order: then no copy in or out is needed). ``block_ids[s * B + b]`` is its ``b``-th block, padded with
    block 0, which the mask hides. ``last_key[kv * S + s]`` is the last position it may see.
    """

    num_segments: int
    num_blocks: int
    query_rows: torch.Tensor | None
    block_ids: torch.Tensor
    last_key: torch.Tensor  # (KV * S, 1, 1), one row per (KV head, segment) like the scores
    key_buffer: torch.Tensor  # where this group's keys are gathered to
    # Mask and value-row indices for one layer shape, built by the first layer and reused by the others.
    layouts: dict[tuple[Any, ...], tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @property
    def output_rows(self) -> torch.Tensor | None:
        return self.query_rows

    def attend(
        self, cache: PagedKVCache, layer: int, query: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """``query`` (1, H, T, D) -> (S, H, D): scores by one batched matmul, output summed from the cached values."""
        _, num_heads, _, head_dim = query.shape
        num_kv_heads, segments = cache.num_kv_heads, self.num_segments
        per_kv = num_heads // num_kv_heads
        mask, value_index, bag_offsets = self.layout(cache, per_kv, window, query.dtype)
        q = query if self.query_rows is None else query.index_select(2, self.query_rows)
        # The query heads that share a KV head are the rows of one small matrix per (KV head, segment).
        q = q.view(num_kv_heads, per_kv, segments, head_dim).transpose(1, 2).reshape(-1, per_kv, head_dim)
        keys = cache.gather(layer, 0, self.block_ids, self.key_buffer).view(num_kv_heads * segments, -1, head_dim)
        scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=scale)  # (KV * S, per_kv, context)
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        # P @ V without copying V: each output row is a probability-weighted sum of value rows of the cache.
        weights = probs.view(-1)
        out = F.embedding_bag(value_index, cache.value_rows[layer], bag_offsets, mode="sum", per_sample_weights=weights)
        return out.view(num_kv_heads, segments, per_kv, head_dim).transpose(0, 1).reshape(segments, num_heads, head_dim)

    def layout(
        self, cache: PagedKVCache, per_kv: int, window: int | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, ...]:
        """The additive mask (KV * S, 1, context), and the ``embedding_bag`` indices and offsets of the values.

        Bag ``(kv, s, p)`` (query head ``p`` of KV head ``kv``, segment ``s``) lists the value rows of
        segment ``s``'s padded context in KV head ``kv``, in the order of its attention scores.
        """
        key = (per_kv, window, dtype)
        if key not in self.layouts:
            mask = additive_mask(self.last_key, self.num_blocks * cache.block_size, window, dtype)
            block_starts = self.block_ids.view(1, self.num_segments, -1, 1) * cache.block_size
            rows = (block_starts + cache.row_offsets).view(cache.num_kv_heads, self.num_segments, 1, -1)
            index = rows.expand(-1, -1, per_kv, -1).reshape(-1)  # (KV, S, per_kv, context), flat
            offsets = torch.arange(0, index.numel(), rows.shape[-1], device=index.device)
            self.layouts[key] = mask, index, offsets
        return self.layouts[key]


def additive_mask(last_key: torch.Tensor, num_keys: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """0 where a query may see key position ``p`` (``p <= last_key``, and within the sliding ``window`` if any),
    -inf elsewhere: added to the attention scores, it masks without a branch. ``last_key``'s last dimension is 1:
    the ``num_keys`` positions fill it."""
    key_pos = torch.arange(num_keys, device=last_key.device)
    visible = key_pos <= last_key
    if window is not None:
        visible &= key_pos > last_key - window
    return torch.where(visible, 0.0, float("-inf")).to(dtype)


@dataclass
class PrefillGroup:
    """``S`` multi-token segments attended together as one padded batch of ``S x Q`` query rows over ``B`` blocks.

    ``query_rows[s * Q + q]`` is the packed row of segment ``s``'s ``q``-th token; rows past a segment's
    end repeat its last token, so that no row is fully masked. ``valid`` picks the real ones (None when
    all are real) and ``output_rows`` says where their results go. Both are None when the group is the
    whole step in packed order (a lone prefill chunk): then no copy is needed.
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
    masks: dict[tuple[Any, ...], torch.Tensor] = field(default_factory=dict)

    def attend(
        self, cache: PagedKVCache, layer: int, query: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """``query`` (1, H, T, D) -> (real rows, H, D); the fused kernel never materialises the scores."""
        _, num_heads, _, head_dim = query.shape
        num_kv_heads, segments, rows = cache.num_kv_heads, self.num_segments, self.num_queries
        per_kv = num_heads // num_kv_heads
        mask = self.mask(cache.block_size, per_kv, window, query.dtype)
        q = query if self.query_rows is None else query.index_select(2, self.query_rows)
        # Query heads that share a KV head become extra query rows of that head: (KV, S, per_kv * Q, D).
        q = q.view(num_kv_heads, per_kv, segments, rows, head_dim).transpose(1, 2)
        q = q.reshape(num_kv_heads, segments, per_kv * rows, head_dim)
        k = cache.gather(layer, 0, self.block_ids, self.buffers[0]).view(num_kv_heads, segments, -1, head_dim)
        v = cache.gather(layer, 1, self.block_ids, self.buffers[1]).view(num_kv_heads, segments, -1, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        # Back to one row per token: (S * Q, H, D).
        out = out.view(num_kv_heads, segments, per_kv, rows, head_dim).permute(1, 3, 0, 2, 4)
        out = out.reshape(segments * rows, num_heads, head_dim)
        return out if self.valid is None else out.index_select(0, self.valid)

    def mask(self, block_size: int, per_kv: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive (1, S, per_kv * Q, context) mask, 0 where a query row may see a key, built once per step."""
        key = (per_kv, window, dtype)
        if key not in self.masks:
            num_keys = self.num_blocks * block_size
            mask = additive_mask(self.last_key[:, :, None], num_keys, window, dtype)  # (S, Q, context)
            # Rows are (query head, query) pairs: repeat the query rows per head.
            mask = mask[:, None].expand(-1, per_kv, -1, -1).reshape(1, self.num_segments, -1, num_keys)
            self.masks[key] = mask
        return self.masks[key]


@dataclass
class FreshPrefillGroup:
    """Prompt chunks with nothing cached before them (``start == 0``): each attends causally to its own tokens.

    Their whole context is the keys and values the layer just computed, so they need neither the cache
    nor a mask: causal ``scaled_dot_product_attention`` per chunk (the fused kernel also skips the
    masked half of the scores). ``spans`` are (first packed row, length); ``output_rows`` says where the
    results go (None when the chunks are the whole step).
    """

    spans: list[tuple[int, int]]
    output_rows: torch.Tensor | None

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """``query`` (1, H, T, D), ``key``/``value`` (1, KV, T, D) -> (rows of the chunks, H, D)."""
        outs = []
        for row, length in self.spans:
            span = slice(row, row + length)
            q, k, v = query[:, :, span], key[:, :, span], value[:, :, span]
            if window is None or length <= window:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:  # causal, and no further back than the sliding window
                position = torch.arange(length, device=query.device)
                distance = position[:, None] - position
                visible = (distance >= 0) & (distance < window)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


#: A per-request attention function with the signature of :func:`paged_attention` (exercise 5's seam).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int], int, float], torch.Tensor]
#: A function with the signature of :func:`slot_mapping` (exercise 2's seam).
SlotMappingFn = Callable[[Sequence[Segment], int, int], list[int]]


@dataclass
class PagedBatch:
    """One step's layout, built once and read by every layer: where to write K/V, what each query attends to.

    With an ``attention_fn`` the groups are empty and each segment is attended on its own by that function.
    """

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # (T,) long: the cache slot each packed token writes its K/V to
    position_ids: torch.Tensor  # (T,) long
    groups: list[DecodeGroup | PrefillGroup | FreshPrefillGroup]
    segments: Sequence[Segment] = ()
    attention_fn: AttentionFn | None = None


def slot_mapping(segments: Sequence[Segment], block_size: int, scratch_slot: int) -> list[int]:
    """The cache slot of every token of a packed step, in packed order (exercise 2).

    Token ``p`` of a segment's request lives in slot ``block_table[p // block_size] * block_size +
    p % block_size``; a padding segment (``writes_cache=False``) writes all its tokens to ``scratch_slot``.
    Python work is one run of slots per block touched, never one division per token.
    """
    slots: list[int] = []
    for start, num_tokens, table, writes_cache in segments:
        if not writes_cache:
            slots.extend([scratch_slot] * num_tokens)
        elif num_tokens == 1:  # a decode row, by far the most common
            slots.append(table[start // block_size] * block_size + start % block_size)
        else:
            position, end = start, start + num_tokens
            while position < end:  # one run of consecutive slots per block
                block, offset = divmod(position, block_size)
                run = min(block_size - offset, end - position)
                first = table[block] * block_size + offset
                slots.extend(range(first, first + run))
                position += run
    return slots


def build_paged_batch(
    cache: PagedKVCache,
    segments: Sequence[Segment],
    device: torch.device,
    *,
    attention_fn: AttentionFn | None = None,
    slot_mapping_fn: SlotMappingFn = slot_mapping,
) -> PagedBatch:
    """Turn a step's segments into the index tensors attention needs.

    Python work is one pass over the segments, one run of slots per block touched and one block id per
    context block: it grows with the tokens computed and the blocks read, never per cached token.
    """
    block_size = cache.block_size
    positions: list[int] = []
    decodes: list[tuple[int, Segment]] = []  # (first packed row, segment)
    prefills: list[tuple[int, Segment]] = []  # chunks that attend to cached keys
    fresh: list[tuple[int, int]] = []  # (first packed row, length) of chunks with nothing cached before them
    for segment in segments:
        start, num_tokens, _, writes_cache = segment
        if num_tokens == 1:  # a decode row, by far the most common: one position
            decodes.append((len(positions), segment))
            positions.append(start)
            continue
        if start == 0 and writes_cache:
            fresh.append((len(positions), num_tokens))
        else:
            prefills.append((len(positions), segment))
        positions.extend(range(start, start + num_tokens))
    num_rows = len(positions)
    slots = slot_mapping_fn(segments, block_size, cache.scratch_slot)
    if len(slots) != num_rows:
        raise ValueError(f"the slot mapping has {len(slots)} slots for a step of {num_rows} tokens")
    groups: list[DecodeGroup | PrefillGroup | FreshPrefillGroup] = []
    if attention_fn is None:
        for members in _split_by_context(decodes, block_size):
            if members:
                groups.append(_decode_group(cache, members, num_rows, device))
        if prefills:
            groups.append(_prefill_group(cache, prefills, num_rows, device))
        if fresh:
            groups.append(_fresh_group(fresh, num_rows, device))
    ids = long_tensor(slots + positions, device)  # one tensor built for both lists
    slot_ids, position_ids = ids[:num_rows], ids[num_rows:]
    return PagedBatch(cache, slot_ids, position_ids, groups, segments, attention_fn)


def context_length(segment: Segment) -> int:
    """Positions the segment's last row attends to: its cached prefix plus, if it writes, its own tokens.

    A padding segment's rows are thrown away; attending to the cached prefix only keeps them harmless.
    """
    return segment.start + segment.num_tokens if segment.writes_cache else segment.start


def _split_by_context(decodes: list[tuple[int, Segment]], block_size: int) -> list[list[tuple[int, Segment]]]:
    """Split decode rows into short- and long-context halves when that saves a quarter of the padded blocks.

    A padded group reads every segment's context up to the longest one's length; a few long requests
    among many short ones would multiply the keys and values read for attention.
    """
    if len(decodes) < 2:
        return [decodes]
    members = sorted(decodes, key=lambda member: context_length(member[1]))
    blocks = [blocks_for(context_length(segment), block_size) for _, segment in members]
    padded, split = min((i * blocks[i - 1] + (len(blocks) - i) * blocks[-1], i) for i in range(1, len(blocks)))
    whole = len(blocks) * blocks[-1]
    if padded > 0.75 * whole or whole - padded < MIN_SPLIT_SAVING_BLOCKS:
        return [decodes]
    return [members[:split], members[split:]]


def table_width(contexts: Sequence[int], block_size: int) -> int:
    """Blocks per row of a step's padded block tables: enough for its longest context (at least one)."""
    return max(1, blocks_for(max(contexts), block_size))


def padded_block_tables(segments: Sequence[Segment], contexts: Sequence[int], block_size: int) -> tuple[list[int], int]:
    """Each segment's context blocks as rows of one width (the longest context's), padded with block 0.

    Only the blocks that cover ``contexts`` are listed: a block no row reads need not be gathered or sent.
    Returns the rows, flattened, and their width.
    """
    width = table_width(contexts, block_size)
    block_ids: list[int] = []
    for segment, context in zip(segments, contexts, strict=True):
        used = blocks_for(context, block_size)
        block_ids += segment.block_table[:used]
        block_ids += [0] * (width - used)
    return block_ids, width


class BlockTableRows:
    """A step's block tables as int32 rows of one width, each table converted once per change, not once per step.

    Turning Python ints into C ints costs tens of nanoseconds each: 256 requests with 800-token contexts
    hold 12,800 block ids, a third of a millisecond per decode step, and a decode step on a GPU takes
    about one. But a block table changes only when its request crosses into a new block. So each table's
    row is kept, as bytes, with a copy of the list it came from. While the table is unchanged, comparing
    it with that copy meets the same int objects and only compares pointers; any change (a new block, a
    preemption, a table rebuilt by a plugged-in allocator) makes them differ, and the row is converted again.
    Rows are found by the table object's ``id``: a new table that reuses an old one's id is compared like any other.
    """

    def __init__(self) -> None:
        self.rows: dict[int, tuple[list[int], bytes]] = {}  # id(table) -> (copy of the table, its int32 row)

    def padded(
        self, tables: Sequence[Sequence[int]], contexts: Sequence[int], block_size: int
    ) -> tuple[bytearray, int]:
        """Each table's context blocks as int32 rows, padded with block 0 to the longest one; and that width.

        The same rows as :func:`padded_block_tables`, as bytes (``tables``: the segments' block tables).
        """
        width = table_width(contexts, block_size)
        rows = self.rows
        if len(rows) > 2 * len(tables) + 64:  # tables of requests that left: keep this step's only
            live = {id(table) for table in tables}
            self.rows = rows = {key: row for key, row in rows.items() if key in live}
        padding = bytes(4 * width)
        flat = bytearray()
        for table, context in zip(tables, contexts, strict=True):
            known = rows.get(id(table))
            if known is None or known[0] != table:
                known = rows[id(table)] = (list(table), array("i", table).tobytes())
            used = 4 * blocks_for(context, block_size)
            # A decode's table covers exactly its context: the whole row, with no slicing.
            flat += known[1] if used == len(known[1]) else known[1][:used]
            if used < len(padding):
                flat += padding[used:]
        return flat, width


def _decode_group(
    cache: PagedKVCache, members: list[tuple[int, Segment]], num_rows: int, device: torch.device
) -> DecodeGroup:
    contexts = [context_length(s) for _, s in members]
    block_ids, num_blocks = padded_block_tables([s for _, s in members], contexts, cache.block_size)
    rows = [row for row, _ in members]
    last_keys = [min(s.start, c - 1) for (_, s), c in zip(members, contexts, strict=True)] * cache.num_kv_heads
    # One tensor built for the three index lists; the pieces are views of it.
    flat = long_tensor(block_ids + rows + last_keys, device)
    num_ids, num_members = len(block_ids), len(members)
    block_id_tensor, query_rows = flat[:num_ids], flat[num_ids : num_ids + num_members]
    last_key = flat[num_ids + num_members :]
    return DecodeGroup(
        num_segments=len(members),
        num_blocks=num_blocks,
        # Decodes sit in packed order, so a group holding every row holds them in order.
        query_rows=None if len(members) == num_rows else query_rows,
        block_ids=block_id_tensor,
        last_key=last_key.view(-1, 1, 1),
        key_buffer=cache.buffers(len(block_ids))[0],
    )


def _prefill_group(
    cache: PagedKVCache, members: list[tuple[int, Segment]], num_rows: int, device: torch.device
) -> PrefillGroup:
    """Query row q of a segment is its token min(q, length - 1): rows past the end repeat the last token."""
    contexts = [context_length(s) for _, s in members]
    block_ids, num_blocks = padded_block_tables([s for _, s in members], contexts, cache.block_size)
    lengths = [s.num_tokens for _, s in members]
    num_queries = max(lengths)
    length = long_tensor(lengths, device)[:, None]
    offsets = torch.arange(num_queries, device=device)
    last = torch.minimum(offsets, length - 1)
    query_rows = (long_tensor([row for row, _ in members], device)[:, None] + last).flatten()
    starts = long_tensor([s.start for _, s in members], device)[:, None]
    context = long_tensor(contexts, device)[:, None]
    last_key = torch.minimum(starts + last, context - 1)  # causal, within the context
    valid = None if min(lengths) == num_queries else torch.nonzero((offsets < length).flatten()).flatten()
    # Segments sit in packed order, so a group holding every row, unpadded, holds them in order.
    in_order = valid is None and len(members) * num_queries == num_rows
    return PrefillGroup(
        num_segments=len(members),
        num_queries=num_queries,
        num_blocks=num_blocks,
        query_rows=None if in_order else query_rows,
        output_rows=None if in_order else (query_rows if valid is None else query_rows[valid]),
        valid=valid,
        block_ids=long_tensor(block_ids, device),
        last_key=last_key,
        buffers=cache.buffers(len(block_ids)),
    )


def _fresh_group(spans: list[tuple[int, int]], num_rows: int, device: torch.device) -> FreshPrefillGroup:
    if sum(length for _, length in spans) == num_rows:  # the chunks are the whole step, in packed order
        return FreshPrefillGroup(spans, None)
    rows = [row + i for row, length in spans for i in range(length)]
    return FreshPrefillGroup(spans, long_tensor(rows, device))


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
    _, num_heads, num_rows, head_dim = query.shape
    scale = head_dim**-0.5 if scaling is None else scaling
    cache, layer = paged_batch.cache, module.layer_idx
    cache.write(layer, paged_batch.slot_mapping, key, value)
    if paged_batch.attention_fn is not None:
        if sliding_window is not None:
            raise ValueError("an attention_fn attends to the whole context; this model uses a sliding window")
        return _attend_each(paged_batch, layer, query[0], scale).unsqueeze(0), None

    output = None
    for group in paged_batch.groups:
        if isinstance(group, FreshPrefillGroup):
            out = group.attend(query, key, value, scale, sliding_window)
        else:
            out = group.attend(cache, layer, query, scale, sliding_window)
        if group.output_rows is None:  # the group is the whole step, in packed order
            return out.unsqueeze(0), None
        if output is None:
            output = query.new_empty((num_rows, num_heads, head_dim))
        output.index_copy_(0, group.output_rows, out)
    return output.unsqueeze(0), None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: Sequence[int],
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one request's newest tokens over its whole context, read from its blocks (exercise 5).

    ``query`` is (H, Q, D): the request's last Q tokens, at positions ``context_len - Q .. context_len - 1``,
    whose keys and values are already in the cache. ``key_cache`` and ``value_cache`` are one layer's
    blocks, (KV, num_blocks, block_size, D); ``block_table`` lists the request's blocks in order. Query
    ``q`` sees the keys at positions ``0 .. context_len - Q + q`` (causal), scaled by ``scale``; the H
    query heads share the KV heads in groups of H // KV (grouped-query attention). Returns (H, Q, D).

    This is the plain definition, one request at a time; the engine's fast path batches requests into
    groups (DecodeGroup, PrefillGroup) and must agree with it.
    """
    num_heads, num_queries, _ = query.shape
    num_kv_heads, _, block_size, head_dim = key_cache.shape
    blocks = torch.as_tensor(list(block_table[: blocks_for(context_len, block_size)]), device=key_cache.device)
    keys = key_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :context_len]
    values = value_cache[:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :context_len]
    keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=0)  # (H, context, D)
    values = values.repeat_interleave(num_heads // num_kv_heads, dim=0)
    scores = (query @ keys.transpose(1, 2)) * scale  # (H, Q, context)
    query_pos = torch.arange(context_len - num_queries, context_len, device=query.device)[:, None]
    visible = torch.arange(context_len, device=query.device) <= query_pos
    scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype) @ values


def _attend_each(batch: PagedBatch, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
    """``query`` (H, T, D) -> (T, H, D): each segment through ``batch.attention_fn``; padding rows stay zero."""
    key_cache, value_cache = batch.cache.parts[layer]
    output = torch.zeros_like(query)
    row = 0
    for start, num_tokens, table, writes_cache in batch.segments:
        if writes_cache:  # a padding row's output is thrown away: nothing to compute
            rows = slice(row, row + num_tokens)
            q = query[:, rows]
            out = batch.attention_fn(q, key_cache, value_cache, table, start + num_tokens, scale)
            if not isinstance(out, torch.Tensor) or out.shape != q.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"attention_fn must return a tensor of the query's shape {tuple(q.shape)}, got {got}")
            output[:, rows] = out
        row += num_tokens
    return output.transpose(0, 1)


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextmanager
def use_paged_attention(model: torch.nn.Module, name: str = ATTENTION_NAME) -> Iterator[None]:
    """Route ``model``'s attention layers to labkit's paged attention ``name`` inside the block, then restore.

    transformers builds no attention mask for an implementation it has no mask function for, so no
    T x T mask is created: the PagedBatch carries the masks.
    """
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
