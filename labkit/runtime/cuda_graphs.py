"""CUDA graphs for decode-only steps: one recorded launch sequence per batch-size bucket.

A decode step of a 0.5B model launches a few hundred small kernels, and launching them one by one
from Python takes longer than running them: the host, not the GPU's memory, sets the pace. A CUDA
graph records the launches of one forward pass once and replays them with a single call.

A graph replays exactly what it recorded: the same kernels, the same grid sizes, the same memory
addresses. So every input lives in a *static buffer* whose address never changes (token ids,
positions, slot mapping, context lengths, block tables), and each step copies its values in before
the replay. Everything a graph bakes in must depend only on its key, here the batch size:

* the batch is padded up to the next bucket (1, 2, 4, 8, then every 8); a padded row gets slot -1
  (the store kernel skips it) and a context of 0 keys (attention writes zeros for it);
* the grid of the attention kernel is the bucket size, and the number of key tiles each program walks
  is read from ``seq_lens`` on the device, so a graph captured while every context was short replays
  correctly once they are long. (transformers once replayed a graph captured for one maximum length at
  another and lost half its accuracy; tests/test_cuda_graphs.py checks exactly this case.)
* the block-table buffer is as wide as the longest request the model allows, so no context outgrows it.

Prefill steps and batches larger than the largest bucket run eagerly. Sampling runs outside the graph,
on the logits it leaves in its output buffer. Graphs are captured largest first into one shared memory
pool (a smaller graph reuses the larger one's memory), after one eager warm-up run per bucket that
compiles the Triton kernels and lets cuBLAS choose its algorithms.

On a CPU (tests under Triton's interpreter) there is nothing to capture: a "replay" calls the forward
on the same static buffers, which checks the padding and the buffer bookkeeping, everything but the
capture itself.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Hashable, Mapping

import torch

from labkit.core.blocks import blocks_for
from labkit.core.request import PENDING_TOKEN, Request
from labkit.core.scheduler import SchedulerOutput
from labkit.runtime.attention import BlockTableRows, PagedKVCache
from labkit.runtime.sampling import feed_back_samples
from labkit.runtime.triton_attention import TritonBatch

Forward = Callable[[torch.Tensor, TritonBatch, int], torch.Tensor]  # (input ids, batch, logits_to_keep) -> logits
HEADER_PARTS = 5  # token ids, positions, slots, context lengths, sampling rows: one upload per step


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to ``max_batch`` (always the last one).

    A batch runs in the smallest bucket that holds it: a few dozen graphs cover every size, and the padding
    costs at most 7 rows (each a slot of -1 and an empty context).
    """
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += list(range(8, max_batch, 8))
    return [*sizes, max_batch]


def logits_bytes(max_batch: int, vocab_size: int, dtype: torch.dtype) -> int:
    """GPU memory that the captured graphs keep beyond the KV cache: each bucket's graph holds its own logits
    output (rows x vocabulary) for its replays. At 256 sequences and Qwen2.5-0.5B's 151,936-token vocabulary in
    bfloat16 that is 1.3 GB, which the runner leaves aside when it sizes the cache from the memory left."""
    return sum(bucket_sizes(max_batch)) * vocab_size * dtype.itemsize


class DecodeGraphs:
    """Captured decode steps of one model over one KV cache, for every bucket up to ``max_batch`` requests.

    ``max_blocks_per_seq`` is the block-table width: enough blocks for the model's longest request.
    ``table_rows`` keeps the block tables' int32 rows between steps (shared with the eager Triton path).
    """

    def __init__(
        self,
        forward: Forward,
        cache: PagedKVCache,
        max_batch: int,
        max_blocks_per_seq: int,
        table_rows: BlockTableRows | None = None,
    ) -> None:
        device = cache.data.device
        self.forward = forward
        self.cache = cache
        self.table_rows = BlockTableRows() if table_rows is None else table_rows
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = max_batch
        self.width = max_blocks_per_seq
        self.captured = device.type == "cuda"
        # Static buffers. header = token ids | positions | slots | context lengths | sampling rows, max_batch each
        # (the graph reads the first four; the sampling rows pick the logits to sample from, after the replay).
        # Each part starts on 16 bytes, as the eager step's tensors do: Triton compiles a kernel anew for a pointer
        # that is not, so a max_batch of 10 would otherwise build every kernel twice.
        self.part_length = -(-max_batch // 4) * 4
        self.header = torch.zeros(HEADER_PARTS * self.part_length, dtype=torch.int32, device=device)
        self.header.view(HEADER_PARTS, self.part_length)[2] = -1  # warm-up and capture store nothing
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        pin = self.captured
        self.host_header = torch.zeros(HEADER_PARTS * self.part_length, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros(max_batch * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.copied = torch.cuda.Event() if self.captured else None  # the last copy out of the host buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.captured else None
        self.num_replays = 0  # decode steps served by a graph (benchmarks and tests read it)
        for size in reversed(self.buckets):
            self._capture(size)

    def _inputs(self, size: int) -> tuple[torch.Tensor, TritonBatch]:
        """Views of the static buffers for a batch of ``size`` rows (the same addresses on every call)."""
        ids, positions, slots, seq_lens, _ = self.header.view(HEADER_PARTS, self.part_length)[:, :size]
        batch = TritonBatch(
            cache=self.cache,
            slot_mapping=slots,
            position_ids=positions,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=seq_lens,
            block_tables=self.block_tables[:size],
            max_query_len=1,
        )
        return ids[None], batch

    @torch.inference_mode()  # the static buffers are inference tensors, made under inference mode
    def _capture(self, size: int) -> None:
        ids, batch = self._inputs(size)
        self.outputs[size] = self.forward(ids, batch, 0)  # warm-up: compiles kernels, picks GEMM algorithms
        if not self.captured:
            return
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA work on another thread (a baseline's) does not invalidate this capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[size] = self.forward(ids, batch, 0)
        self.graphs[size] = graph

    def can_run(self, output: SchedulerOutput) -> bool:
        """A decode-only step (one token per chunk, padding included) that fits a bucket and the block-table width."""
        chunks, padding = output.chunks, output.padding
        if not chunks or len(chunks) + len(padding) > self.max_batch:
            return False
        if any(chunk.num_tokens != 1 for chunk in (*chunks, *padding)):
            return False
        longest = max(chunk.start for chunk in chunks) + 1
        return blocks_for(longest, self.cache.block_size) <= self.width

    def run(
        self,
        output: SchedulerOutput,
        tables: Mapping[Hashable, list[int]],
        previous_rows: Mapping[Hashable, int] | None = None,
        previous_samples: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[Request]]:
        """Copy a decode step into the static buffers and replay its bucket's graph.

        Returns the logits of the rows that sample, one row each, and whose they are. One pass over the chunks
        builds every input, as slot_mapping and context_length would: a row at position ``p`` writes slot
        ``table[p // block_size] * block_size + p % block_size`` and attends to ``p + 1`` keys; a static
        batch's padding row (a finished member) stores nothing and attends to its cached ``p`` keys. Async
        scheduling: a PENDING_TOKEN input is the token the previous step sampled in row
        ``previous_rows[request_id]`` of ``previous_samples``, still on the device; it is named ``-1 - row``
        and gathered there. Two host-to-device copies: the header (HEADER_PARTS x max_batch ints) and the used
        corner of the block tables. Where some row samples nothing (a long prompt's one-token chunk), the header's
        sampling rows pick the logits on the device: an index built from a Python list would be a third copy,
        from pageable memory, which waits for the GPU.
        """
        chunks, padding = output.chunks, output.padding
        n = len(chunks) + len(padding)
        size = self.buckets[bisect_left(self.buckets, n)]
        block_size = self.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        rows: list[list[int]] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        fed_back = None
        for chunk in chunks:
            request, start = chunk.request, chunk.start
            table = tables[request.request_id]
            token = request.token_at(start)
            if token == PENDING_TOKEN:
                token = -1 - previous_rows[request.request_id]
                fed_back = previous_samples
            if chunk.samples:  # all but a long prompt's one-token chunk that does not reach its end
                sample_rows.append(len(ids))
                sampling.append(request)
            ids.append(token)
            positions.append(start)
            slots.append(table[start // block_size] * block_size + start % block_size)
            seq_lens.append(start + 1)
            rows.append(table)
        for chunk in padding:
            table = tables[chunk.request.request_id]
            ids.append(0)
            positions.append(chunk.start)
            slots.append(-1)
            seq_lens.append(chunk.start)
            rows.append(table)
        flat_tables, width = self.table_rows.padded(rows, seq_lens, block_size)
        # Every row of the bucket is rewritten; a bucket's padded rows get token 0 at position 0, no slot, no context.
        # (Lists converted at once: appending to a list is cheaper than converting each int into an int32 array.)
        zeros, no_slots = [0] * (size - n), [-1] * (size - n)
        sampling_rows = sample_rows + [0] * (size - len(sample_rows))
        header = array("i", ids + zeros + positions + zeros + slots + no_slots + seq_lens + zeros + sampling_rows)
        if self.copied is not None:  # the pinned buffers are reused: the previous step's copy must have read them
            self.copied.synchronize()
        host_header = self.host_header.view(HEADER_PARTS, self.part_length)[:, :size]
        host_header.copy_(torch.frombuffer(header, dtype=torch.int32).view(HEADER_PARTS, size))
        host_tables = self.host_tables[: n * width].view(n, width)
        host_tables.copy_(torch.frombuffer(flat_tables, dtype=torch.int32).view(n, width))
        self.header.copy_(self.host_header, non_blocking=True)
        self.block_tables[:n, :width].copy_(host_tables, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if fed_back is not None:
            feed_back_samples(self.header[:n], fed_back)
        self.num_replays += 1
        if self.captured:
            self.graphs[size].replay()
        else:
            input_ids, batch = self._inputs(size)
            self.outputs[size] = self.forward(input_ids, batch, 0)
        logits = self.outputs[size]
        if len(sample_rows) == len(chunks):  # every chunk samples: the first rows, as they are
            return logits[: len(chunks)], sampling
        rows_index = self.header.view(HEADER_PARTS, self.part_length)[-1, : len(sample_rows)]
        return logits.index_select(0, rows_index), sampling
