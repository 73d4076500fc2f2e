"""The iteration-level scheduler: before every model step, decide which requests run and how many tokens each.

Every step has one token budget (``max_batch_tokens``) shared by everything that runs: a decoding
request costs one token, a prefilling request costs the part of its prompt that fits. There is no
separate "prefill phase": prompts and decodes go into the same packed batch (as in vLLM v1).

Two policies:

* ``"continuous"`` - running requests go first, oldest first; then waiting requests are admitted in
  the waiting queue's order while budget, ``max_num_seqs`` and free blocks allow. Long prompts are
  split into chunks (chunked prefill). A finished request frees its blocks at once. When a running
  request needs a block and none is free, the last running request (the most recently admitted, or
  under ``"priority"`` the lowest-ranked) is preempted and later recomputed from scratch. With prefix
  caching, an admitted request starts from the cached blocks of its prompt's longest cached prefix
  and computes only the rest; blocks its computed tokens fill are indexed after each step.
* ``"static"`` - the classic padded batch: a new batch starts only when the previous one has fully
  finished; each member reserves blocks for prompt + ``max_new_tokens`` up front; finished members
  keep their row (computed and thrown away) until the longest member is done. Those rows, and the
  padding of shorter prompts, are counted as wasted slots.

The order of the waiting queue is the scheduling policy (``labkit.core.queues``): first come first
served, by priority (a waiting request may preempt a running one it outranks), or shortest first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.core.blocks import BlockAllocator
from labkit.core.config import EngineConfig
from labkit.core.queues import QUEUES
from labkit.core.request import Request, RequestState


class ScheduledChunk(NamedTuple):
    """Tokens ``start .. start + num_tokens - 1`` of ``request`` are computed this step.

    ``samples`` is true when the chunk reaches the end of the request's known tokens, so the model's
    output at its last position becomes the next generated token.
    """

    request: Request
    start: int
    num_tokens: int
    is_prefill: bool
    samples: bool


@dataclass
class SchedulerOutput:
    """What the model runs in one step. ``padding`` rows (static policy only) are computed but discarded."""

    step: int
    chunks: list[ScheduledChunk]
    padding: list[ScheduledChunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Token rows the model computes this step, padding included."""
        return sum(c.num_tokens for c in self.chunks) + self.num_padding_tokens

    @property
    def num_padding_tokens(self) -> int:
        return sum(c.num_tokens for c in self.padding)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.padding


class Scheduler:
    """Owns the waiting queue and the running set; the allocator owns the blocks."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting = QUEUES[config.scheduling]()
        self.running: list[Request] = []  # in the queue's order (admission, or rank): the last is preempted first
        self.requests: dict[int, Request] = {}  # every unfinished request, by id
        self.step_index = 0
        self.prefix_caching = getattr(allocator, "prefix_cache", None) is not None

    # ------------------------------------------------------------------ requests in and out
    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise ValueError for a request that this configuration could never finish."""
        cfg, capacity = self.config, self.allocator.num_blocks * self.allocator.block_size
        # The last generated token is never fed back, so it needs no cache slot.
        needed = num_prompt_tokens + max_new_tokens - 1
        if needed > capacity:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) needs {needed}"
                f" cache slots, but the whole KV cache holds {capacity}"
                f" ({self.allocator.num_blocks} blocks x {self.allocator.block_size})"
            )
        if cfg.policy == "static" and num_prompt_tokens > cfg.max_batch_tokens:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) is longer than max_batch_tokens"
                f" ({cfg.max_batch_tokens}); the static policy prefills a prompt in one step"
            )
        if cfg.policy == "continuous" and not cfg.chunked_prefill and needed > cfg.max_batch_tokens:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds"
                f" max_batch_tokens ({cfg.max_batch_tokens}); without chunked prefill a request must"
                " be computable (and recomputable after preemption) in one step"
            )

    def add(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.params.max_new_tokens)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request, self.step_index)

    def abort(self, request_id: int, now: float) -> Request:
        """Finish a request with reason ``"abort"``; raise KeyError if no such request is unfinished."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif self.config.policy == "continuous":
            self.running.remove(request)
        self._finish(request, "abort", now)
        if self.config.policy == "static":
            self._end_static_batch_if_done()
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        self.allocator.step = self.step_index
        if self.config.policy == "static":
            return self._schedule_static()
        return self._schedule_continuous()

    def update(self, output: SchedulerOutput, sampled: Sequence[int], now: float) -> list[Request]:
        """Record the tokens the model produced (one per sampling chunk, in order); return finished requests."""
        finished = []
        tokens = iter(sampled)
        for chunk in output.chunks:
            request = chunk.request
            if self.prefix_caching:  # the step wrote these tokens' keys and values: index the full blocks
                self.allocator.cache_full_blocks(request)
            if not chunk.samples:
                continue
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.token_times.append(now)
            request.state = RequestState.DECODING
            reason = request.append_token(next(tokens))
            if reason is not None:
                self._finish(request, reason, now)
                finished.append(request)
        if finished:
            if self.config.policy == "continuous":
                self.running = [r for r in self.running if r.state is not RequestState.FINISHED]
            else:
                self._end_static_batch_if_done()
        return finished

    # ------------------------------------------------------------------ continuous batching
    def _schedule_continuous(self) -> SchedulerOutput:
        cfg, allocator = self.config, self.allocator
        output = SchedulerOutput(step=self.step_index, chunks=[])
        budget = cfg.max_batch_tokens
        if self.waiting.preempts:
            budget = self._admit_outranking(output, budget)
        displaced = len(output.preempted)
        fresh = {r.request_id for r in output.admitted}  # already scheduled this step

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            num_tokens = min(remaining, budget)
            if request.request_id in fresh or (num_tokens < remaining and not cfg.chunked_prefill):
                i += 1  # admitted above, or does not fit whole: wait for a step with more room
                continue
            end = request.num_computed_tokens + num_tokens
            needed = allocator.blocks_needed(request.request_id, end)  # usually 0: decodes fill the last block
            while needed > allocator.num_free_blocks:
                victim = self.running.pop()  # most recently admitted, or lowest-ranked
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            if request.state is RequestState.WAITING:  # preempted itself: nothing younger was left
                break
            allocator.allocate(request.request_id, end)
            self._add_chunk(output, request, num_tokens)
            budget -= num_tokens
            i += 1

        # Admit new work only when no running request had to be preempted for blocks: otherwise we would
        # evict and admit at once. (Displacing lower-ranked requests for a better one, above, is the point.)
        if len(output.preempted) == displaced:
            while self.waiting and budget > 0 and (used := self._admit_next(output, budget)):
                budget -= used
        return output

    def _admit_next(self, output: SchedulerOutput, budget: int) -> int:
        """Admit the head of the waiting queue with its first chunk if a seat, the budget and the blocks allow.

        Returns the chunk's tokens, or 0 if it cannot start now. With prefix caching it starts from the
        cached blocks of its longest cached prefix, and its first chunk is the rest of its tokens.
        """
        cfg, allocator = self.config, self.allocator
        if len(self.running) >= cfg.max_num_seqs:
            return 0
        request = self.waiting.peek()
        prefix = allocator.match_prefix(request) if self.prefix_caching else None
        start = len(prefix.blocks) * allocator.block_size if prefix is not None else 0
        remaining = request.num_tokens - start
        num_tokens = min(remaining, budget)
        if num_tokens < remaining and not cfg.chunked_prefill:
            return 0
        if not allocator.can_allocate(request.request_id, start + num_tokens, prefix):
            return 0
        self.waiting.pop()
        allocator.allocate(request.request_id, start + num_tokens, prefix)
        request.num_computed_tokens = start  # the cached prefix is already computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = start
        self._admit(output, request)
        self._add_chunk(output, request, num_tokens)
        return num_tokens

    def _admit_outranking(self, output: SchedulerOutput, budget: int) -> int:
        """Priority: waiting requests that outrank the last running one start first, displacing it if they must.

        Returns the budget left. The displaced request is the lowest-ranked running one; it is recomputed later.
        """
        while budget > 0 and self.waiting and self.running:
            head, last = self.waiting.peek(), self.running[-1]
            if not self.waiting.outranks(head, last):
                break
            used = self._admit_next(output, budget)
            if used:
                budget -= used
            elif not self.config.chunked_prefill and head.num_tokens > budget:
                break  # it needs a step with more budget, not more room
            else:
                self.running.pop()
                self._preempt(last)
                output.preempted.append(last)
        return budget

    def _preempt(self, request: Request) -> None:
        """Release the request's blocks and put it back in the waiting queue, to be recomputed."""
        self.allocator.free(request.request_id)
        request.num_computed_tokens = 0
        request.state = RequestState.WAITING
        request.metrics.num_preemptions += 1
        self.waiting.requeue(request)

    # ------------------------------------------------------------------ static batching
    def _schedule_static(self) -> SchedulerOutput:
        cfg, allocator = self.config, self.allocator
        output = SchedulerOutput(step=self.step_index, chunks=[])
        if not self.running:  # the previous batch is completely done: form a new one
            longest = 0
            while self.waiting and len(self.running) < cfg.max_num_seqs:
                request = self.waiting.peek()
                padded_rows = (len(self.running) + 1) * max(longest, request.num_prompt_tokens)
                reserve = request.num_prompt_tokens + request.params.max_new_tokens - 1
                if padded_rows > cfg.max_batch_tokens or not allocator.can_allocate(request.request_id, reserve):
                    break
                self.waiting.pop()
                allocator.allocate(request.request_id, reserve)
                longest = max(longest, request.num_prompt_tokens)
                self._admit(output, request)
                self.running.append(request)
            for request in self.running:
                self._add_chunk(output, request, request.num_prompt_tokens)
                if request.num_prompt_tokens < longest:  # right-padding up to the longest prompt
                    pad = longest - request.num_prompt_tokens
                    output.padding.append(ScheduledChunk(request, request.num_prompt_tokens, pad, True, False))
            return output

        for request in self.running:
            if request.state is RequestState.FINISHED:  # a dead row that stays in the batch
                output.padding.append(ScheduledChunk(request, request.num_computed_tokens, 1, False, False))
            else:
                self._add_chunk(output, request, 1)
        return output

    def _end_static_batch_if_done(self) -> None:
        if self.running and all(r.state is RequestState.FINISHED for r in self.running):
            for request in self.running:
                self.allocator.free(request.request_id)
            self.running = []

    # ------------------------------------------------------------------ shared helpers
    def _admit(self, output: SchedulerOutput, request: Request) -> None:
        request.state = RequestState.PREFILLING
        if self.config.policy == "continuous":
            self.waiting.place(self.running, request)
        output.admitted.append(request)

    def _add_chunk(self, output: SchedulerOutput, request: Request, num_tokens: int) -> None:
        start = request.num_computed_tokens
        is_prefill = request.state is RequestState.PREFILLING
        request.num_computed_tokens = start + num_tokens
        samples = request.num_computed_tokens == request.num_tokens
        output.chunks.append(ScheduledChunk(request, start, num_tokens, is_prefill, samples))

    def _finish(self, request: Request, reason: str, now: float) -> None:
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.metrics.finish_time = now
        del self.requests[request.request_id]
        self.waiting.forget(request)
        if self.config.policy == "continuous" and request.request_id in self.allocator.block_tables:
            self.allocator.free(request.request_id)
