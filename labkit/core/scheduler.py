"""The iteration-level scheduler: before every model step, decide which requests run and how many tokens each.

Every step has one token budget (``max_batch_tokens``) shared by everything that runs: a decoding
request costs one token, a prefilling request costs the part of its prompt that fits. There is no
separate "prefill phase": prompts and decodes go into the same packed batch (as in vLLM v1).

Two policies:

* ``"continuous"`` - running requests go first, oldest first (under ``"priority"``, in rank order);
  then waiting requests are admitted in the waiting queue's order while budget, ``max_num_seqs`` and
  free blocks allow. Long prompts are split into chunks (chunked prefill). A finished request frees its
  blocks at once. When a running request needs a block and none is free, the last running request (the
  most recently admitted, or under ``"priority"`` the lowest-ranked) is preempted and later recomputed
  from scratch. With prefix caching, an admitted request starts from the cached blocks of its prompt's
  longest cached prefix and computes only the rest; the blocks a step's tokens fill are indexed when it
  commits.
* ``"static"`` - the classic padded batch: a new batch starts only when the previous one has fully
  finished; each member reserves blocks for prompt + ``max_new_tokens`` - 1 tokens up front (the last
  token is never fed back, so never cached); finished members
  keep their row (computed and thrown away) until the longest member is done. Those rows, and the
  padding of shorter prompts, are counted as wasted slots. A padded batch is a rectangle: its ``n``
  rows are as long as the longest prompt ``L``, so its prefill computes ``n * L`` rows, of which
  ``n * L - sum(prompts)`` are padding. Members join a batch while that rectangle fits one step's
  budget; a prompt longer than the budget forms a batch of its own (it has nothing to pad) and is
  prefilled in chunks of the budget, as continuous batching would. Decoding starts once every
  member's prompt is in.

The order of the waiting queue is the scheduling policy (``labkit.core.queues``): first come first
served, by priority (a waiting request may preempt a running one it outranks), or shortest first.

A step is a plan and then a commit. ``schedule()`` only *plans*: it reads the queues and requests
and returns a SchedulerOutput, and the only state it changes is the allocator's (blocks for the
chunks, blocks freed by preemption), inside an allocator checkpoint. ``update()`` *commits* the plan
once the model has run: it moves admitted and preempted requests between the queues, advances each
chunk's ``num_computed_tokens``, records the sampled tokens. If anything fails in between,
``rollback()`` undoes the allocator and the scheduler is exactly as before ``schedule()``: nothing
else was touched. A subclass keeps that contract by changing requests and queues only in ``update``.

With async scheduling (``EngineConfig.async_scheduling``) a step is committed before its tokens are known:
``update()`` records placeholders (PENDING_TOKEN), the next step is planned from there, and ``resolve()`` puts
the tokens in place once they are read, finishing then a request that a stop token ended.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.core.blocks import BlockAllocator
from labkit.core.config import EngineConfig
from labkit.core.prefix_cache import PrefixMatch
from labkit.core.queues import QUEUES
from labkit.core.request import PENDING_TOKEN, Request, RequestState

# A request's states, as module globals: the loops below test or set them once per request and step, and Python
# 3.10 and 3.11 take about 70 ns to look a member up on an Enum class (``RequestState.DECODING``), several times a
# global's cost (their Enum classes answer attribute lookups through a Python ``__getattr__``).
WAITING, PREFILLING = RequestState.WAITING, RequestState.PREFILLING
DECODING, FINISHED = RequestState.DECODING, RequestState.FINISHED


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
    num_cached_tokens: dict[int, int] = field(default_factory=dict)  # admitted request id -> tokens from the cache

    def add_chunk(self, request: Request, start: int, num_tokens: int, is_prefill: bool) -> None:
        """Plan tokens ``start .. start + num_tokens - 1`` of ``request``; reaching its last token samples."""
        samples = start + num_tokens == request.num_tokens
        self.chunks.append(ScheduledChunk(request, start, num_tokens, is_prefill, samples))

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


class ResolvedStep(NamedTuple):
    """What ``Scheduler.resolve`` did with a step's sampled tokens (async scheduling)."""

    tokens: list[int | None]  # per sampling chunk: the token kept, or None where it was dropped
    stopped: list[Request]  # requests that a stop token finished


class Scheduler:
    """Owns the waiting queue and the running set; the allocator owns the blocks."""

    def __init__(self, config: EngineConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting = QUEUES[config.scheduling]()
        self.running: list[Request] = []  # in the queue's order (admission, or rank): the last is preempted first
        self.requests: dict[int, Request] = {}  # every unfinished request, by id
        self.step_index = 0
        self.evict_first: list[Request] = []  # preempted by a step that failed: see rollback()
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
        if cfg.policy == "static" and not cfg.chunked_prefill and num_prompt_tokens > cfg.max_batch_tokens:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) is longer than max_batch_tokens ({cfg.max_batch_tokens});"
                " without chunked prefill the static policy prefills a prompt in one step"
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
        while request.output_token_ids and request.output_token_ids[-1] == PENDING_TOKEN:  # async: never read
            request.output_token_ids.pop()
            request.metrics.token_times.pop()
        if not request.output_token_ids:  # no token was ever read: no time to first token
            request.metrics.first_token_time = None
        self._finish_now(request, "abort", now)
        if self.config.policy == "static":
            self._end_static_batch_if_done()
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Only the allocator changes here, inside a checkpoint; ``update`` commits."""
        self.allocator.checkpoint()
        self.allocator.step = self.step_index + 1
        if self.config.policy == "static":
            return self._schedule_static()
        return self.schedule_continuous()

    def rollback(self, output: SchedulerOutput | None = None) -> None:
        """Forget the planned step: put the allocator back as it was before ``schedule()``.

        What the model wrote into the KV cache cannot be rolled back: if the step preempted requests,
        their blocks may now hold other requests' keys and values. So the next plan evicts them first,
        as the failed step did (when nothing changed in between, the very same requests; one that the failed step
        admitted in a victim's place may wait a step, when that step also preempted for blocks).
        """
        self.allocator.rollback()
        if output is not None and output.preempted:
            self.evict_first = list(output.preempted)

    def update(self, output: SchedulerOutput, sampled: Sequence[int], now: float) -> list[Request]:
        """Commit the planned step with the tokens the model produced (one per sampling chunk, in order).

        What can fail comes first, while the allocator can still roll back: the check of ``sampled``,
        indexing the blocks this step filled (prefix caching), freeing the blocks of the requests this
        step finishes (a plugged-in allocator may raise) and requeueing its victims (``requeue_preempted``,
        undone if it raises). Then the allocator commits and the plan is applied with plain assignments: the
        queues, each chunk's ``num_computed_tokens``, the new tokens. Returns the requests that finished.
        """
        sampling = [chunk.request for chunk in output.chunks if chunk.samples]
        if len(sampled) != len(sampling):
            raise ValueError(f"the step samples {len(sampling)} tokens, but the model returned {len(sampled)}")
        reasons = list(map(Request.finish_reason_for, sampling, sampled))
        finishing = [r for r, why in zip(sampling, reasons, strict=True) if why] if any(reasons) else []
        if self.prefix_caching:  # the step wrote these tokens' keys and values: index the blocks they filled
            placeholders = self.config.async_scheduling  # a chunk may end on a token whose value is not known yet
            for chunk in output.chunks:
                end = chunk.start + chunk.num_tokens
                if placeholders and chunk.request.token_at(end - 1) == PENDING_TOKEN:
                    end -= 1  # its block is indexed by resolve(), once the token is known
                self.allocator.cache_full_blocks(chunk.request, end)
        ends_batch = self._free_finished(output, finishing)
        self._requeue_all(output.preempted)
        self.allocator.commit()  # the point of no return

        self.step_index = output.step
        self.evict_first = []
        for request in output.admitted:  # they were the head of the queue, before the victims went back in
            self.waiting.remove(request)
            self.waiting.place(self.running, request)
            request.state = PREFILLING
        for request_id, num_cached in output.num_cached_tokens.items():
            request = self.requests[request_id]
            if request.num_cached_tokens is None:  # a recomputation does not count again
                request.num_cached_tokens = num_cached

        for chunk in output.chunks:
            chunk.request.num_computed_tokens = chunk.start + chunk.num_tokens
        finished = []
        for request, token, reason in zip(sampling, sampled, reasons, strict=True):
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.token_times.append(now)
            request.state = DECODING
            request.output_token_ids.append(token)
            if reason is not None:
                self._finish(request, reason, now)
                finished.append(request)
        if finished and self.config.policy == "continuous":
            self.running = [r for r in self.running if r.state is not FINISHED]
        elif ends_batch:
            self.running = []
        return finished

    def resolve(self, output: SchedulerOutput, sampled: Sequence[int], now: float) -> ResolvedStep:
        """Async scheduling: put the tokens step ``output`` sampled in place of its placeholders (PENDING_TOKEN).

        ``update`` committed the step with placeholders, and the next step has already been planned and
        launched as if every request went on. A request whose token is a stop token finishes here, one step
        late: what the next step computed for it is dropped, with its blocks. A token whose request was
        aborted, or stopped, meanwhile is dropped too. Returns the tokens kept (None for a dropped one) and
        the requests that stopped. If it raises, the step is left unresolved: called again, it resolves it whole.
        """
        sampling = [chunk for chunk in output.chunks if chunk.samples]
        if len(sampled) != len(sampling):
            raise ValueError(f"the step samples {len(sampling)} tokens, but the model returned {len(sampled)}")
        kept: list[int | None] = []  # per sampling chunk
        resolved: list[tuple[Request, int, int]] = []  # (request, where in its output, token) for each kept token
        for chunk, token in zip(sampling, sampled, strict=True):
            request = chunk.request
            index = chunk.start + chunk.num_tokens - len(request.prompt_token_ids)  # where the token went
            outputs = request.output_token_ids
            pending = index < len(outputs) and outputs[index] == PENDING_TOKEN  # else aborted or stopped meanwhile
            kept.append(token if pending else None)
            if pending:
                resolved.append((request, index, token))
        # The tokens go in place first: the blocks this step completed hold the tokens it fed, some sampled by
        # this very step. Then what may raise, under a checkpoint as in update(): indexing those blocks (prefix
        # caching) and freeing a stopped request's blocks (a plugged-in allocator may raise). If it does, the
        # tokens are taken out again, and the next call resolves the whole step anew.
        in_batch = (PREFILLING, DECODING)  # not finished, not preempted meanwhile
        self.allocator.checkpoint()
        try:
            for request, index, token in resolved:
                request.output_token_ids[index] = token
                if self.prefix_caching and request.state in in_batch:
                    self.allocator.cache_full_blocks(request, request.num_computed_tokens)  # the block it completed
                if token in request.stop_ids and request.state in in_batch:
                    self._free_if_continuous(request)
        except BaseException:
            self.allocator.rollback()
            for request, index, _ in resolved:
                request.output_token_ids[index] = PENDING_TOKEN
            raise
        self.allocator.commit()
        # Then plain assignments.
        stopped = []
        for request, index, token in resolved:
            outputs, metrics = request.output_token_ids, request.metrics
            metrics.token_times[index] = now
            if index == 0:
                metrics.first_token_time = now
            if token in request.stop_ids:
                del outputs[index + 1 :], metrics.token_times[index + 1 :]  # the next step's token, if any
                if request.state is FINISHED:  # by length, at the commit of this step or the next
                    request.finish_reason, metrics.finish_time = "stop", now
                else:
                    if request.state is WAITING:  # the next step preempted it, not knowing it had stopped:
                        metrics.num_preemptions -= 1  # a request that has finished is not preempted (Engine drops it)
                    self._finish_now(request, "stop", now, freed=True)
                stopped.append(request)
            elif request.state is FINISHED:  # by length: the commit could tell, but the token arrives now
                metrics.finish_time = now
        return ResolvedStep(kept, stopped)

    def _free_finished(self, output: SchedulerOutput, finishing: list[Request]) -> bool:
        """Free the blocks this step gives back; return whether it ends the static batch.

        Continuous batching frees a finished request's blocks at once; a static batch keeps every
        member's blocks until its last member finishes.
        """
        if self.config.policy == "continuous":
            for request in finishing:
                self.allocator.free(request.request_id)
            return False
        if not finishing:
            return False
        batch = self.running or output.admitted
        if any(r.state is not FINISHED and r not in finishing for r in batch):
            return False
        for request in batch:
            self.allocator.free(request.request_id)
        return True

    # ------------------------------------------------------------------ continuous batching
    def schedule_continuous(self) -> SchedulerOutput:
        """Plan one continuous-batching step within the token budget (exercise 3).

        Running requests first, in order, each with its next decode token or prompt chunk; when one
        needs a block and none is free, the last running request (the most recently admitted, or the
        lowest-ranked) is preempted (:meth:`preempt`). Then waiting requests are admitted in the queue's
        order while budget, ``max_num_seqs`` and free blocks allow, unless this step preempted. A prompt
        that does not fit the budget is chunked when ``chunked_prefill`` is on, and otherwise waits for a
        step with room. Under ``"priority"`` requests are served in rank order, running or waiting: a
        waiting request that outranks the next running one is admitted before it, displacing the
        lowest-ranked running requests if it must.
        """
        cfg, allocator, running = self.config, self.allocator, self.running
        output = SchedulerOutput(step=self.step_index + 1, chunks=[])
        budget = cfg.max_batch_tokens
        waiting = iter(self.waiting)  # admissions take the queue's head in order, across both loops below
        head = next(waiting, None)
        displacing = self.waiting.preempts  # priority: a better waiting request may displace running ones

        num_kept = len(running)  # running[:num_kept] are not preempted: victims leave from the end
        # A failed step's victims (still the end of the list, unless aborted since) must not run.
        num_evict_first = sum(1 for r in self.evict_first if r.state is not FINISHED)
        num_may_run = len(running) - num_evict_first  # running[:num_may_run] may run this step
        preempted_for_blocks = False  # a request was preempted for another's blocks (not displaced by a better one)
        i = 0
        while i < num_may_run and budget > 0:
            request = running[i]
            if displacing and head is not None and self.waiting.outranks(head, request):
                # The head outranks this request and every one after it: it goes first, displacing the
                # lowest-ranked running requests until it fits (unless even all of them would not make room).
                if not self._room_if_displaced(head, budget, running[i:num_kept]):
                    displacing = False
                    continue
                while not (used := self._admit(output, head, budget, num_kept)) and num_kept > i:
                    if not cfg.chunked_prefill and head.num_tokens - self._cached_prefix(head)[1] > budget:
                        break  # what it must compute needs a step with more budget, not more room
                    num_kept -= 1
                    self.preempt(output, running[num_kept])
                num_may_run = min(num_may_run, num_kept)
                if not used:  # it cannot start this step: the requests it outranks run as usual
                    displacing = False
                    continue
                budget -= used
                head = next(waiting, None)
                continue
            # Without chunked prefill a running request has one token left: its whole prompt went in at admission.
            computed = request.num_computed_tokens
            remaining = request.num_tokens - computed
            num_tokens = remaining if remaining <= budget else budget  # min(), without a builtin call's ~90 ns
            end = computed + num_tokens
            needed = allocator.blocks_needed(request.request_id, end)
            if needed:  # usually 0: decodes fill the last block
                while needed > allocator.num_free_blocks and num_kept > i:
                    num_kept -= 1
                    self.preempt(output, running[num_kept])  # the most recently admitted, or lowest-ranked
                    preempted_for_blocks = True
                if num_kept == i:  # preempted itself: nothing younger was left
                    break
                num_may_run = min(num_may_run, num_kept)
            allocator.allocate(request.request_id, end)
            output.add_chunk(request, computed, num_tokens, request.state is PREFILLING)
            budget -= num_tokens
            i += 1
        while num_kept > num_may_run:  # the failed step's victims that nothing has evicted yet
            num_kept -= 1
            self.preempt(output, running[num_kept])
            # It is first in line again, and no newcomer may pass it: nothing is admitted, unless the queue
            # ranks requests (priority), where the check below admits only requests that outrank it.
            preempted_for_blocks |= not self.waiting.preempts

        # Admit new work only when no running request had to be preempted for blocks: otherwise we would
        # evict and admit at once. (Displacing lower-ranked requests for a better one, above, is the point;
        # but the room a victim left goes to no one it outranks: it waits ahead of them.)
        if not preempted_for_blocks:
            victims = output.preempted
            while (
                head is not None
                and budget > 0
                and not any(self.waiting.outranks(victim, head) for victim in victims)
                and (used := self._admit(output, head, budget, num_kept))
            ):
                budget -= used
                head = next(waiting, None)
        return output

    def _admit(self, output: SchedulerOutput, request: Request, budget: int, num_running: int) -> int:
        """Plan to admit ``request`` with its first chunk if a seat, the budget and the blocks allow.

        Returns the chunk's tokens, or 0 if it cannot start now (``num_running``: running requests that
        stay this step). With prefix caching it starts from the cached blocks of its longest cached
        prefix, and its first chunk is the rest of its tokens.
        """
        cfg, allocator = self.config, self.allocator
        if num_running + len(output.admitted) >= cfg.max_num_seqs:
            return 0
        prefix, start = self._cached_prefix(request)
        remaining = request.num_tokens - start
        num_tokens = min(remaining, budget)
        if num_tokens < remaining and not cfg.chunked_prefill:
            return 0
        if not allocator.can_allocate(request.request_id, start + num_tokens, prefix):
            return 0
        allocator.allocate(request.request_id, start + num_tokens, prefix)
        output.admitted.append(request)
        if prefix is not None:
            output.num_cached_tokens[request.request_id] = start
        output.add_chunk(request, start, num_tokens, True)
        return num_tokens

    def _room_if_displaced(self, request: Request, budget: int, victims: Sequence[Request]) -> bool:
        """Whether ``request``'s first chunk could get its blocks if all ``victims`` gave theirs up.

        Displacing requests that cannot make enough room would only make them compute their tokens again.
        It counts as ``can_allocate`` would once they are gone: the victims free the blocks no one else
        holds, and a cached block ``request`` would share that is then free (a victim's shared prefix, say)
        is taken back from the free blocks, not added to them.
        """
        allocator = self.allocator
        prefix, start = self._cached_prefix(request)
        cached = prefix.blocks if prefix is not None else []
        needed = allocator.blocks_needed(request.request_id, start + min(request.num_tokens - start, budget))
        held = Counter(block for victim in victims for block in allocator.block_tables.get(victim.request_id, ()))
        freed = sum(1 for block, holders in held.items() if allocator.ref_counts[block] == holders)
        revived = sum(1 for block in cached if allocator.ref_counts[block] == held[block])
        return needed - len(cached) <= allocator.num_free_blocks + freed - revived

    def _cached_prefix(self, request: Request) -> tuple[PrefixMatch | None, int]:
        """The cached blocks ``request`` would start from (None with prefix caching off), and the tokens they hold."""
        if not self.prefix_caching:
            return None, 0
        prefix = self.allocator.match_prefix(request)
        return prefix, len(prefix.blocks) * self.allocator.block_size

    def preempt(self, output: SchedulerOutput, victim: Request) -> None:
        """Plan to preempt ``victim`` (exercise 4): free all its blocks now and list it in ``output.preempted``."""
        self.allocator.free(victim.request_id)
        output.preempted.append(victim)

    def _requeue_all(self, victims: list[Request]) -> None:
        """Move the step's victims from the running list (they are its end) back to the queue, before the commit:
        if ``requeue_preempted`` raises, everything is put back as it was."""
        if not victims:
            return
        before = [(v, v.state, v.num_computed_tokens, v.metrics.num_preemptions) for v in victims]
        running = list(self.running)
        del self.running[len(running) - len(victims) :]
        try:
            for victim in victims:
                self.requeue_preempted(victim)
        except BaseException:
            self.running[:] = running
            for victim, state, computed, preemptions in before:
                victim.state, victim.num_computed_tokens, victim.metrics.num_preemptions = state, computed, preemptions
                while any(r is victim for r in self.waiting):
                    self.waiting.remove(victim)
            raise

    def requeue_preempted(self, victim: Request) -> None:
        """Commit a preemption (exercise 4): ``victim`` waits again, first in line, to be recomputed from scratch.
        (It is out of ``self.running`` already.)

        Its keys and values went with its blocks, so ``num_computed_tokens`` restarts at 0; it keeps the
        tokens it generated, so recomputing prompt + output gives the same next tokens as before.
        """
        victim.state = WAITING
        victim.num_computed_tokens = 0
        victim.metrics.num_preemptions += 1
        self.waiting.requeue(victim)

    # ------------------------------------------------------------------ static batching
    def _schedule_static(self) -> SchedulerOutput:
        output = SchedulerOutput(step=self.step_index + 1, chunks=[])
        batch = self.running or self.form_static_batch(output)
        if not batch:
            return output
        if any(r.num_computed_tokens < r.num_prompt_tokens for r in batch):  # prefill the padded batch's next columns
            longest = max(r.num_prompt_tokens for r in batch)
            done = max(r.num_computed_tokens for r in batch)  # prompt columns computed in every row
            width = min(self.config.max_batch_tokens // len(batch), longest - done)
            for request in batch:
                real = min(done + width, request.num_prompt_tokens) - done
                output.add_chunk(request, done, real, True)
                if real < width:  # right-padding of a shorter prompt
                    output.padding.append(ScheduledChunk(request, done + real, width - real, True, False))
            return output
        for request in batch:  # every prompt is in: one decode row per member, finished ones included
            if request.state is FINISHED:  # a dead row that stays in the batch
                output.padding.append(ScheduledChunk(request, request.num_computed_tokens, 1, False, False))
            else:
                output.add_chunk(request, request.num_computed_tokens, 1, False)
        return output

    def form_static_batch(self, output: SchedulerOutput) -> list[Request]:
        """The previous batch is done: plan a new one from the head of the queue (exercise 7; ``update`` admits it).

        Members join while seats and cache allow and the prompts, padded to the longest, still prefill in
        one step; a first prompt longer than the budget makes a batch of one. Each member reserves blocks
        for prompt + ``max_new_tokens`` - 1 tokens up front (its last token is never fed back).
        """
        cfg, allocator, longest = self.config, self.allocator, 0
        for request in self.waiting:
            if len(output.admitted) >= cfg.max_num_seqs:
                break
            padded_longest = max(longest, request.num_prompt_tokens)
            if output.admitted and (len(output.admitted) + 1) * padded_longest > cfg.max_batch_tokens:
                break
            reserve = request.num_prompt_tokens + request.params.max_new_tokens - 1
            if not allocator.can_allocate(request.request_id, reserve):
                break
            allocator.allocate(request.request_id, reserve)
            longest = padded_longest
            output.admitted.append(request)
        return output.admitted

    def _end_static_batch_if_done(self) -> None:
        if self.running and all(r.state is FINISHED for r in self.running):
            for request in self.running:
                self.allocator.free(request.request_id)
            self.running = []

    # ------------------------------------------------------------------ shared helpers
    def _finish_now(self, request: Request, reason: str, now: float, freed: bool = False) -> None:
        """Finish an unfinished request between steps: (continuous) its blocks freed, unless ``freed`` already,
        then out of its queue. The freeing comes first: a plugged-in allocator may raise, and nothing has
        changed yet."""
        if request.state is WAITING:
            self.waiting.remove(request)
        else:
            if not freed:
                self._free_if_continuous(request)
            if self.config.policy == "continuous":
                self.running.remove(request)
        self._finish(request, reason, now)

    def _free_if_continuous(self, request: Request) -> None:
        """A running request's blocks go back when it finishes; a static batch keeps them to its end."""
        if self.config.policy == "continuous":
            self.allocator.free(request.request_id)

    def _finish(self, request: Request, reason: str, now: float) -> None:
        request.state = FINISHED
        request.finish_reason = reason
        request.metrics.finish_time = now
        del self.requests[request.request_id]
        self.waiting.forget(request)
