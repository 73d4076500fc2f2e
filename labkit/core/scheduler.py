"""The iteration-level scheduler: before every model step, decide which requests run and how many tokens each.

Every step has one token budget (``max_batch_tokens``) shared by everything that runs: a decoding
request costs one token, a prefilling request costs the part of its prompt that fits. There is no
separate "prefill phase": prompts and decodes go into the same packed batch (as in vLLM v1).

Two policies:

* ``"continuous"`` - running requests go first, oldest first; then waiting requests are admitted in
  arrival order while budget, ``max_num_seqs`` and free blocks allow. Long prompts are split into
  chunks (chunked prefill). A finished request frees its blocks at once. When a running request
  needs a block and none is free, the most recently admitted request is preempted and later
  recomputed from scratch.
* ``"static"`` - the classic padded batch: a new batch starts only when the previous one has fully
  finished; each member reserves blocks for prompt + ``max_new_tokens`` up front; finished members
  keep their row (computed and thrown away) until the longest member is done. Those rows, and the
  padding of shorter prompts, are counted as wasted slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.core.blocks import BlockAllocator
from labkit.core.config import EngineConfig
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
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[int, Request] = {}  # every unfinished request, by id
        self.step_index = 0

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
        self.waiting.append(request)

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
        return self.schedule_continuous()

    def update(self, output: SchedulerOutput, sampled: Sequence[int], now: float) -> list[Request]:
        """Record the tokens the model produced (one per sampling chunk, in order); return finished requests."""
        finished = []
        tokens = iter(sampled)
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            request = chunk.request
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
    def schedule_continuous(self) -> SchedulerOutput:
        """One continuous-batching step (exercise 3): running requests first, then admissions, within the budget.

        Running requests go in admission order, each with one decode token or the next chunk of its
        prompt; when one needs a block and none is free, :meth:`preempt_one` evicts the youngest. Then
        waiting requests are admitted in arrival order while budget, ``max_num_seqs`` and free blocks
        allow, unless this step preempted. A prompt that does not fit the budget is chunked when
        ``chunked_prefill`` is on, and otherwise waits for a step with room.
        """
        cfg, allocator = self.config, self.allocator
        output = SchedulerOutput(step=self.step_index, chunks=[])
        budget = cfg.max_batch_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            num_tokens = min(remaining, budget)
            if num_tokens < remaining and not cfg.chunked_prefill:
                i += 1  # does not fit whole: wait for a step with more room
                continue
            end = request.num_computed_tokens + num_tokens
            needed = allocator.blocks_needed(request.request_id, end)  # usually 0: decodes fill the last block
            while needed > allocator.num_free_blocks and self.preempt_one(output) is not request:
                pass
            if request.state is RequestState.WAITING:  # preempted itself: nothing younger was left
                break
            allocator.allocate(request.request_id, end)
            self.add_chunk(output, request, num_tokens)
            budget -= num_tokens
            i += 1

        # Admit new work only when nothing had to be preempted: otherwise we would evict and admit at once.
        while self.waiting and budget > 0 and not output.preempted and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            remaining = request.num_tokens
            num_tokens = min(remaining, budget)
            if num_tokens < remaining and not cfg.chunked_prefill:
                break
            if not allocator.can_allocate(request.request_id, num_tokens):
                break
            self.waiting.popleft()
            allocator.allocate(request.request_id, num_tokens)
            self.admit(output, request)
            self.add_chunk(output, request, num_tokens)
            budget -= num_tokens
        return output

    def preempt_one(self, output: SchedulerOutput) -> Request:
        """Evict the most recently admitted running request to free its blocks (exercise 4); return it.

        The victim leaves ``running``, gives all its blocks back, and goes to the front of the waiting
        queue with ``num_computed_tokens = 0``: it is recomputed from its prompt plus the tokens it has
        already generated, so its output is unchanged. It is listed in ``output.preempted``.
        """
        request = self.running.pop()
        self.allocator.free(request.request_id)
        request.num_computed_tokens = 0
        request.state = RequestState.WAITING
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)
        output.preempted.append(request)
        return request

    # ------------------------------------------------------------------ static batching
    def _schedule_static(self) -> SchedulerOutput:
        output = SchedulerOutput(step=self.step_index, chunks=[])
        if not self.running:  # the previous batch is completely done: form a new one
            self.form_static_batch(output)
            longest = max((r.num_prompt_tokens for r in self.running), default=0)
            for request in self.running:
                self.add_chunk(output, request, request.num_prompt_tokens)
                if request.num_prompt_tokens < longest:  # right-padding up to the longest prompt
                    pad = longest - request.num_prompt_tokens
                    output.padding.append(ScheduledChunk(request, request.num_prompt_tokens, pad, True, False))
            return output

        for request in self.running:
            if request.state is RequestState.FINISHED:  # a dead row that stays in the batch
                output.padding.append(ScheduledChunk(request, request.num_computed_tokens, 1, False, False))
            else:
                self.add_chunk(output, request, 1)
        return output

    def form_static_batch(self, output: SchedulerOutput) -> None:
        """The static policy's admission rule (exercise 7): admit the next batch, in arrival order.

        Called when the previous batch has completely finished. Waiting requests join while the batch
        has fewer than ``max_num_seqs`` members, its padded prompt rows (members x longest prompt) stay
        within ``max_batch_tokens``, and the allocator can reserve each member's blocks for prompt +
        ``max_new_tokens`` - 1 tokens up front; the first request that does not fit ends the batch.
        Each member is reserved and then admitted with :meth:`admit`.
        """
        cfg, allocator = self.config, self.allocator
        longest = 0
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[0]
            padded_rows = (len(self.running) + 1) * max(longest, request.num_prompt_tokens)
            reserve = request.num_prompt_tokens + request.params.max_new_tokens - 1
            if padded_rows > cfg.max_batch_tokens or not allocator.can_allocate(request.request_id, reserve):
                break
            self.waiting.popleft()
            allocator.allocate(request.request_id, reserve)
            longest = max(longest, request.num_prompt_tokens)
            self.admit(output, request)

    def _end_static_batch_if_done(self) -> None:
        if self.running and all(r.state is RequestState.FINISHED for r in self.running):
            for request in self.running:
                self.allocator.free(request.request_id)
            self.running = []

    # ------------------------------------------------------------------ shared helpers
    def admit(self, output: SchedulerOutput, request: Request) -> None:
        """Move a request (already taken off ``waiting``, its blocks allocated) into ``running``."""
        request.state = RequestState.PREFILLING
        self.running.append(request)
        output.admitted.append(request)

    def add_chunk(self, output: SchedulerOutput, request: Request, num_tokens: int) -> None:
        """Schedule the request's next ``num_tokens`` tokens this step and count them as computed."""
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
        if self.config.policy == "continuous" and request.request_id in self.allocator.block_tables:
            self.allocator.free(request.request_id)
