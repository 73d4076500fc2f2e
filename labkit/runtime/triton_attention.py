"""Paged attention in Triton: one kernel launch per layer for any mix of prefill chunks and decodes.

The plain-torch path (labkit.runtime.attention) groups a step's segments by kind and gathers each
group's context into a padded copy. On a GPU that copy, and the dozens of small torch calls around it,
cost more than the attention itself. Here one *varlen* kernel reads keys and values straight from the
cache blocks, driven by three small tensors per step:

* ``query_start_loc`` (N + 1): request ``s``'s query rows are ``query_start_loc[s] .. query_start_loc[s+1]``
  of the packed step (a prompt chunk has many, a decode one);
* ``seq_lens`` (N): how many keys request ``s`` attends to, cached ones and its own new ones;
* ``block_tables`` (N, W): request ``s``'s ``b``-th block is ``block_tables[s, b]``.

A query row of request ``s`` sits at position ``seq_lens[s] - q_len + i`` and sees every key up to it
(causal masking offset by the context already cached), and no further back than a sliding window.

Each program owns one *query tile* of one request and one KV head. The query heads that share that KV
head (grouped-query attention) are packed into the rows of one matrix, ``BLOCK_M = BLOCK_Q x GROUP``
rows, so every key tile is loaded once for all of them. Key tiles of ``TILE`` positions walk the
context; each position finds its physical block through the block table, so any block size works.
The softmax is computed online in fp32 (running maximum and sum), and the scores never leave the chip.
The loop bounds come from ``seq_lens`` in device memory, never from Python: a CUDA graph captured at one
context length replays correctly at any other (labkit.runtime.cuda_graphs).

A second, tiny kernel stores the step's new keys and values through the slot mapping; a slot of -1 (a
padded row of a CUDA graph's batch) is skipped.

A decode step of a few requests has few programs (batch 1 of a model with 2 KV heads: 2), each walking a
long context one tile at a time while most of the GPU waits. Such a step splits every context into up to
16 parts, one program each, which write their part's output and log-sum-exp; a third kernel merges the
parts, weighting each by its share of the softmax sum (the idea behind "flash decoding").
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from transformers import AttentionInterface

from labkit.runtime.attention import BlockTableRows, PagedKVCache, Segment, context_length, slot_mapping

TRITON_ATTENTION_NAME = "labkit_triton"
ALIGN = 4  # int32s in 16 bytes
LOG2E = 1.4426950408889634
# A KV head's part of the cache with this many elements or more is addressed with 64-bit offsets.
WIDE_OFFSETS_FROM = 2**31
MAX_SPLITS = 16  # parts a decode context is split into, at most


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_head,
    stride_cache_slot,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """Program (token, KV head): copy one head's key and value row of one token into its cache slot."""
    token = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a padded row: nothing to store
        return
    d = tl.arange(0, HEAD_PAD)
    mask = d < HEAD_DIM
    cache_offset = head * stride_cache_head + slot * stride_cache_slot + d
    key = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + d, mask=mask)
    tl.store(key_cache_ptr + cache_offset, key, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + d, mask=mask)
    tl.store(value_cache_ptr + cache_offset, value, mask=mask)


# Triton compiles a variant per value class of each int (1, a multiple of 16, other) and per 16-byte alignment
# of each pointer. The batch size and the block-table width change from step to step: not specialised on, so
# that no step of a run waits for a compile (the metadata pointers are kept aligned by build_triton_batch).
@triton.jit(do_not_specialize=["num_seqs", "stride_block_table"])
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    num_seqs,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_head,
    stride_cache_block,
    stride_cache_slot,
    stride_block_table,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,
    WINDOW: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Program (query tile, KV head, split): attention of up to BLOCK_Q query rows x GROUP heads over their
    context, or over one of NUM_SPLITS consecutive parts of it (decode only; see paged_attention)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:  # one row per request: program = request
        seq = pid
        q_tile = 0
    else:
        # Request s's tiles start at query_start_loc[s] // BLOCK_Q + s: at least one tile per request, and
        # enough for its rows whatever their alignment (the grid has T // BLOCK_Q + N programs). Binary search.
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_tile = pid - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    if q_tile * BLOCK_Q >= q_len:  # a spare program of a short request
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before this step's rows

    # Row m of the tile: query row q_tile * BLOCK_Q + m // GROUP, query head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_local = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows // GROUP < BLOCK_Q) & (q_local < q_len)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q_offset = (q_begin + q_local).to(tl.int64)[:, None] * stride_query_token + head[:, None] * stride_query_head
    q = tl.load(query_ptr + q_offset + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    position = context + q_local  # each row's position; it sees keys <= position

    # Keys any row of the tile may see: [first, end).
    end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(context + q_tile * BLOCK_Q - WINDOW + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    # Offsets are counted within this KV head's part of the cache, in 32 bits unless that part is larger:
    # each key position costs a register per offset, and 64-bit ones halve what fits on the chip.
    key_cache_ptr += kv_head.to(tl.int64) * stride_cache_head
    value_cache_ptr += kv_head.to(tl.int64) * stride_cache_head
    tile_begin = first // TILE
    tile_end = tl.cdiv(end, TILE)
    if NUM_SPLITS > 1:  # this program walks its split's share of the key tiles (none, if the context is short)
        per_split = tl.cdiv(tile_end - tile_begin, NUM_SPLITS)
        tile_begin += split * per_split
        tile_end = tl.minimum(tile_end, tile_begin + per_split)
    for tile in range(tile_begin, tile_end):
        j = tile * TILE + tl.arange(0, TILE)
        j_ok = j < end
        block = tl.load(block_tables_ptr + seq * stride_block_table + j // BLOCK_SIZE, mask=j_ok, other=0)
        if WIDE_OFFSETS:
            block = block.to(tl.int64)
        kv_offset = block * stride_cache_block + (j % BLOCK_SIZE) * stride_cache_slot
        k = tl.load(key_cache_ptr + kv_offset[None, :] + d[:, None], mask=j_ok[None, :] & d_ok[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # (BLOCK_M, TILE), log2 units
        visible = j_ok[None, :] & (j[None, :] <= position[:, None])
        if WINDOW > 0:
            visible = visible & (j[None, :] > position[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        # Online softmax: rescale what was summed so far to the new running maximum.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + kv_offset[:, None] + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a row with no keys (a padded row) gets zeros
    if NUM_SPLITS > 1:  # this split's normalised output and log2-sum-exp, for _merge_splits_kernel
        num_heads = tl.num_programs(1) * GROUP
        part = ((q_begin + q_local).to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        row_mask = row_ok[:, None] & d_ok[None, :]
        tl.store(partial_out_ptr + part[:, None] * HEAD_PAD + d[None, :], out, mask=row_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(partial_lse_ptr + part, lse, mask=row_ok)
        return
    out_offset = (q_begin + q_local).to(tl.int64)[:, None] * stride_out_token + head[:, None] * stride_out_head
    tl.store(out_ptr + out_offset + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Program (token, query head): combine the splits' outputs, each weighted by its share of the softmax sum.

    Split s saw keys whose exp-sum is 2^lse_s; the whole row's output is the lse-weighted mean of the
    splits' normalised outputs. A split that saw no keys has lse = -inf and weight 0; a row whose splits
    all saw none (a padded row) gets zeros.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    lse = tl.load(partial_lse_ptr + part)
    top = tl.max(lse, 0)
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)))
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    parts = tl.load(partial_out_ptr + part[:, None] * HEAD_PAD + d[None, :], mask=d_ok[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    out_offset = token * stride_out_token + head * stride_out_head
    tl.store(out_ptr + out_offset + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` (T, KV, D; any strides, last one 1) into the caches at ``slot_mapping`` (T,).

    The caches are one layer's (KV, blocks, block_size, D) halves of a PagedKVCache; slot -1 is skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_last_dim(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(2),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of the packed ``query`` rows (T, H, D) over their requests' paged contexts -> (T, H, D).

    ``max_query_len`` (a Python int the caller knows without asking the device) picks the variant:
    1 means every request decodes one token, and the grid is one program per request and KV head.
    A decode step with too few of those to keep the GPU busy splits each context into ``num_splits``
    parts (rounded up to a power of two), one program each, and a second kernel merges them (default on
    CUDA: :func:`decode_splits`; elsewhere 1).
    Everything the launch bakes in (grid, tile sizes, variant, splits) depends only on T, N and the
    shapes, which is what lets a CUDA graph capture it once per batch size. ``tile`` (key positions per
    loop step, a power of two >= 16) and ``num_warps`` override :func:`launch_shape` (benchmarks sweep them).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads")
    _check_last_dim(query=query, key_cache=key_cache, value_cache=value_cache)
    if out is None:
        out = query.new_empty((num_tokens, num_heads, head_dim))
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))  # tl.dot wants at least 16 rows
    block_q = block_m // group
    decode_only = max_query_len == 1
    if not decode_only:
        num_splits = 1
    elif num_splits is None:  # a CPU runs the interpreter: nothing to spread
        num_splits = decode_splits(num_seqs * num_kv_heads, sm_count(query.device)) if query.is_cuda else 1
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    num_splits = triton.next_power_of_2(num_splits)  # the merge kernel loads all splits as one vector
    grid = (num_seqs if decode_only else num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    head_pad = max(16, triton.next_power_of_2(head_dim))
    default_tile, default_warps = launch_shape(head_pad)
    partial_out = partial_lse = out  # not read unless the context is split
    if num_splits > 1:
        partial_out = torch.empty((num_tokens, num_heads, num_splits, head_pad), dtype=torch.float32, device=out.device)
        partial_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=out.device)
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        partial_out,
        partial_lse,
        scale * LOG2E,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE=tile or default_tile,
        WIDE_OFFSETS=key_cache.stride(0) >= WIDE_OFFSETS_FROM,  # one KV head's part of the cache, in elements
        WINDOW=sliding_window or 0,
        DECODE_ONLY=decode_only,
        NUM_SPLITS=num_splits,
        # fp32 runs are parity checks: full-precision dots, not TF32.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # Triton's CPU interpreter multiplies bfloat16 matrices wrongly: it gets them in float32.
        DOT_FP32=query.dtype == torch.bfloat16 and query.device.type == "cpu",
        num_warps=num_warps or default_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial_out,
            partial_lse,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_splits,
        )
    return out


def decode_splits(num_programs: int, num_sms: int) -> int:
    """How many parts to split each context of a decode step into, for ``num_programs`` (requests x KV heads).

    One program per request and KV head walks its whole context, one key tile after another, each waiting on
    memory: a handful of them (batch 1 of a model with 2 KV heads runs 2) leaves most of a GPU idle. Splitting
    brings the step to at least two programs per streaming multiprocessor where MAX_SPLITS parts allow (the
    count of parts is rounded up to a power of two). It depends on the batch size only, not the contexts, so a
    CUDA graph's launch stays valid.
    """
    wanted = -(-2 * num_sms // max(num_programs, 1))
    return min(MAX_SPLITS, triton.next_power_of_2(wanted)) if wanted > 1 else 1


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_shape(head_pad: int) -> tuple[int, int]:
    """(key tile, warps) for a padded head size: the largest tile that keeps every variant free of register
    spills on both an H100/H200 (sm_90) and a T4 (sm_75), as their compilers report (tests/test_kernel_build.py)."""
    if head_pad <= 64:
        return 32, 4
    return 16, (4 if head_pad <= 128 else 8)


def _check_last_dim(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along its last (head) dimension")


# ---------------------------------------------------------------------------------------------- the runtime side
@dataclass
class TritonBatch:
    """One step's layout for the Triton kernels: what every layer reads, built once per step.

    All index tensors are int32 views of one upload (see :class:`StepUploader`). A padding segment of a
    static batch (``writes_cache=False``) stores nothing (slot -1) and attends to its cached positions
    only; its rows are thrown away, so its causal offset need not match the torch path's.
    """

    cache: PagedKVCache
    slot_mapping: torch.Tensor  # (T,)
    position_ids: torch.Tensor  # (T,)
    query_start_loc: torch.Tensor  # (N + 1,)
    seq_lens: torch.Tensor  # (N,)
    block_tables: torch.Tensor  # (N, W)
    max_query_len: int


class StepUploader:
    """Moves a step's int32 metadata to the device in one copy, through one reusable pinned buffer.

    A step's index lists are packed into one ``array("i")``, copied into page-locked host memory and sent
    with one asynchronous copy; every tensor the step needs is a view of the result. The buffer is reused
    (grown by doubling), so before it is overwritten the previous copy must have read it: an event recorded
    after each copy says so. (Most steps end by reading their sampled tokens, which waits for much more;
    a step that samples nothing, a middle chunk of a long prompt, does not.)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.table_rows = BlockTableRows()  # kept between steps, shared with the runner's decode graphs
        self.pinned = torch.empty(0, dtype=torch.int32)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def upload(self, values: array) -> torch.Tensor:
        """``values`` as an int32 tensor on the device (on a CPU, a view of ``values`` itself)."""
        host = torch.frombuffer(values, dtype=torch.int32)
        if self.copied is None:
            return host
        self.copied.synchronize()  # the previous copy has read the buffer (an event never recorded: at once)
        if self.pinned.numel() < len(values):
            self.pinned = torch.empty(max(len(values), 2 * self.pinned.numel()), dtype=torch.int32, pin_memory=True)
        staged = self.pinned[: len(values)]
        staged.copy_(host)
        data = staged.to(self.device, non_blocking=True)
        self.copied.record()
        return data


def build_triton_batch(
    cache: PagedKVCache,
    segments: Sequence[Segment],
    token_ids: list[int],
    sample_rows: list[int],
    uploader: StepUploader,
) -> tuple[torch.Tensor, TritonBatch, torch.Tensor | int]:
    """(input ids (1, T), the step's TritonBatch, logits_to_keep) from the step's segments, in one upload."""
    block_size = cache.block_size
    positions: list[int] = []
    query_start_loc = [0]
    for start, num_tokens, _, _ in segments:
        positions.extend(range(start, start + num_tokens))
        query_start_loc.append(len(positions))
    seq_lens = [context_length(segment) for segment in segments]
    slots = slot_mapping(segments, block_size, scratch_slot=-1)  # -1: the store kernel skips the row
    flat_tables, width = uploader.table_rows.padded([s.block_table for s in segments], seq_lens, block_size)
    # 0 keeps every row: a pure decode step samples from all of them, and then needs no index.
    keep_all = len(sample_rows) == len(token_ids)
    keep_rows = [] if keep_all else sample_rows
    # Each part starts on a 16-byte boundary (a multiple of ALIGN ints): Triton specialises kernels on the
    # alignment of their pointers, so unaligned parts would compile new variants as the step sizes change.
    values, offsets = array("i"), []
    for part in (token_ids, positions, slots, query_start_loc, seq_lens, keep_rows):
        offsets.append(len(values))
        values.extend(part)
        values.extend([0] * (-len(values) % ALIGN))
    offsets.append(len(values))
    values.frombytes(flat_tables)
    data = uploader.upload(values)
    sizes = [len(token_ids)] * 3 + [len(query_start_loc), len(seq_lens), len(keep_rows), len(seq_lens) * width]
    pieces = [data[offset : offset + size] for offset, size in zip(offsets, sizes, strict=True)]
    input_ids, position_ids, slot_ids, query_start, lens, keep, block_tables = pieces
    batch = TritonBatch(
        cache=cache,
        slot_mapping=slot_ids,
        position_ids=position_ids,
        query_start_loc=query_start,
        seq_lens=lens,
        block_tables=block_tables.view(len(seq_lens), width),
        max_query_len=max(segment.num_tokens for segment in segments),
    )
    return input_ids[None], batch, 0 if keep_all else keep


def triton_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    paged_batch: TritonBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: query (1, H, T, D), key/value (1, KV, T, D) -> (1, T, H, D), two launches."""
    if not isinstance(paged_batch, TritonBatch):
        raise ValueError(f"the {TRITON_ATTENTION_NAME!r} attention runs inside labkit's ModelRunner")
    head_dim = query.shape[-1]
    key_cache, value_cache = paged_batch.cache.parts[module.layer_idx]
    store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache, paged_batch.slot_mapping)
    out = paged_attention(
        query[0].transpose(0, 1),
        key_cache,
        value_cache,
        paged_batch.query_start_loc,
        paged_batch.seq_lens,
        paged_batch.block_tables,
        head_dim**-0.5 if scaling is None else scaling,
        max_query_len=paged_batch.max_query_len,
        sliding_window=sliding_window,
    )
    return out.unsqueeze(0), None


AttentionInterface.register(TRITON_ATTENTION_NAME, triton_attention_forward)
