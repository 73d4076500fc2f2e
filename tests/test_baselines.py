"""Baselines report real per-request timestamps, so the bench measures them like labkit's engine.

Runs on a 2-layer random model (one thread); vLLM is replaced by a stand-in module so the step loop
that timestamps its tokens is tested without installing it.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import labkit.serving.baselines
import labkit.serving.bench.cli
import labkit.serving.bench.modes
from labkit import Engine, EngineConfig, SamplingParams
from labkit.serving.baselines import (
    PAGE_SIZE,
    TimeLimitReached,
    TransformersContinuous,
    padded_generate,
    timed_padded_generate,
    vllm_serve,
)
from labkit.serving.bench import BenchSetup, load_model, main, results_json, run_bench
from labkit.serving.metrics import run_metrics
from labkit.serving.workloads import WorkloadRequest, make_workload

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12] * 9, [13, 14, 15]]
WANTED = [3, 6, 4, 5]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module")
def greedy(model):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in WANTED]
    return [o.output_token_ids for o in Engine(model, EngineConfig(num_blocks=32)).generate(PROMPTS, params)]


def check_timestamps(outputs, wanted):
    for output, n in zip(outputs, wanted, strict=True):
        m = output.metrics
        assert len(output.output_token_ids) == len(m.token_times) == n
        assert m.token_times == sorted(m.token_times)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time == m.token_times[0]
        assert m.finish_time == m.token_times[-1]


def test_padded_generate_timestamps_each_row_by_its_own_tokens(model, greedy):
    outputs = timed_padded_generate(model, PROMPTS, WANTED, batch_size=2)
    assert [o.output_token_ids for o in outputs] == greedy == padded_generate(model, PROMPTS, WANTED, batch_size=2)
    check_timestamps(outputs, WANTED)
    first, second = outputs[0].metrics, outputs[1].metrics  # one batch: the same steps
    assert second.token_times[:3] == first.token_times
    assert outputs[2].metrics.first_scheduled_time >= second.finish_time  # the next batch waits for the whole one
    assert [o.finish_reason for o in outputs] == ["length"] * 4


def test_a_static_batch_stamps_each_token_between_the_step_that_computed_it_and_the_next(model):
    """generate streams the prompt before any step runs: that call is no token, so it must not take a timestamp."""
    starts, ends = [], []
    before = model.register_forward_pre_hook(lambda *args: starts.append(time.perf_counter()))
    after = model.register_forward_hook(lambda *args: ends.append(time.perf_counter()))
    try:
        (output,) = timed_padded_generate(model, PROMPTS[:1], [4])
    finally:
        before.remove()
        after.remove()
    times = output.metrics.token_times
    assert len(starts) == len(ends) == len(times) == 4  # one forward pass per token, the prefill making the first
    for step, t in enumerate(times):
        assert ends[step] <= t
        assert step + 1 == len(starts) or t <= starts[step + 1]


def test_padded_generate_serves_arrivals_in_batches_of_what_has_arrived(model, greedy):
    outputs = timed_padded_generate(model, PROMPTS, WANTED, batch_size=4, arrival_times=[0.0, 0.0, 0.3, 0.3])
    assert [o.output_token_ids for o in outputs] == greedy
    check_timestamps(outputs, WANTED)
    start = outputs[0].metrics.arrival_time
    assert outputs[2].metrics.arrival_time == pytest.approx(start + 0.3)
    assert outputs[0].metrics.first_scheduled_time == outputs[1].metrics.first_scheduled_time < start + 0.3
    assert outputs[2].metrics.first_scheduled_time == outputs[3].metrics.first_scheduled_time >= start + 0.3


def test_padded_generate_serves_requests_in_arrival_order_not_input_order(model, greedy):
    """The request listed second arrives first: it is served alone, before the other one has even arrived."""
    outputs = timed_padded_generate(model, PROMPTS[:2], WANTED[:2], batch_size=2, arrival_times=[0.2, 0.0])
    assert [o.output_token_ids for o in outputs] == greedy[:2]
    late, early = outputs[0].metrics, outputs[1].metrics
    assert early.first_scheduled_time < late.arrival_time <= late.first_scheduled_time


def test_padded_generate_is_greedy_and_eos_free_whatever_the_models_generation_config_says(model, greedy, monkeypatch):
    """Checkpoints ship sampling settings, logits processors (Qwen2.5-Instruct's repetition_penalty) and an EOS id
    that generate would apply; the baseline decodes plain greedy as labkit does, and leaves the model's generation
    config as it found it."""
    stop = greedy[1][2]
    shipped = {
        "do_sample": True,
        "temperature": 5.0,  # sampled tokens would be far from greedy
        "repetition_penalty": 5.0,
        "no_repeat_ngram_size": 1,
        "suppress_tokens": sorted({t for row in greedy for t in row}),
        "eos_token_id": stop,
    }
    for name, value in shipped.items():
        monkeypatch.setattr(model.generation_config, name, value)
    assert padded_generate(model, PROMPTS, WANTED, batch_size=2) == greedy
    assert {name: getattr(model.generation_config, name) for name in shipped} == shipped


def test_a_static_batch_ends_once_every_row_has_stopped(model, greedy):
    """generate stops a batch whose every row reached EOS: the steps it would have wasted are not run."""
    stop = greedy[1][2]
    passes = []
    handle = model.register_forward_hook(lambda *args: passes.append(1))
    try:
        (output,) = timed_padded_generate(model, PROMPTS[1:2], WANTED[1:2], eos_token_ids={stop})
    finally:
        handle.remove()
    assert len(passes) == len(output.output_token_ids) == greedy[1].index(stop) + 1 < WANTED[1]


def test_padded_generate_runs_past_the_default_length_of_generate(model, greedy_reference):
    """Without its max_new_tokens, generate would stop at its default max_length of 20 tokens, prompt included."""
    prompts, wanted = [[12] * 9, [10, 11]], [30, 4]
    expected = [greedy_reference(model, p, n) for p, n in zip(prompts, wanted, strict=True)]
    assert padded_generate(model, prompts, wanted) == expected


def test_padded_generate_attends_to_prompt_tokens_equal_to_the_pad_id(model, greedy_reference):
    """Only the left padding is masked: a real token that happens to equal pad_token_id is still read."""
    prompts, wanted = [[0, 5, 0, 6], [7, 8, 9, 10, 11, 12]], [5, 5]
    expected = [greedy_reference(model, p, n) for p, n in zip(prompts, wanted, strict=True)]
    assert padded_generate(model, prompts, wanted, pad_token_id=0) == expected


def test_padded_generate_stops_at_eos_when_asked(model, greedy):
    stop = greedy[1][2]
    (output,) = timed_padded_generate(model, PROMPTS[1:2], WANTED[1:2], eos_token_ids={stop})
    assert output.output_token_ids == greedy[1][: greedy[1].index(stop) + 1]
    assert output.finish_reason == "stop"
    assert len(output.metrics.token_times) == len(output.output_token_ids)


def test_a_static_batch_cuts_each_row_at_its_own_eos(model, greedy):
    """A row that stops early is filled with padding until the batch ends; its output keeps only its own tokens."""
    stop = greedy[1][2]
    outputs = timed_padded_generate(model, PROMPTS, WANTED, batch_size=4, eos_token_ids={stop})
    assert any(stop not in tokens for tokens in greedy)  # some rows run on after that one stopped
    for output, tokens in zip(outputs, greedy, strict=True):
        cut = tokens[: tokens.index(stop) + 1] if stop in tokens else tokens
        assert output.output_token_ids == cut
        assert output.finish_reason == ("stop" if stop in tokens else "length")
        assert len(output.metrics.token_times) == len(cut)


def test_a_static_batch_of_one_serves_the_requests_one_after_another(model, greedy):
    outputs = timed_padded_generate(model, PROMPTS, WANTED, batch_size=1)
    assert [o.output_token_ids for o in outputs] == greedy
    for before, after in itertools.pairwise(outputs):
        assert before.metrics.finish_time <= after.metrics.first_scheduled_time


def test_padded_generate_refuses_a_generate_that_does_not_stream_its_steps(model, monkeypatch):
    """The tokens' times come from generate's streamer: without them there is nothing honest to report."""
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *args, streamer, **kwargs: generate(*args, **kwargs))
    with pytest.raises(RuntimeError, match="generate streamed 0 steps but returned 3 tokens"):
        timed_padded_generate(model, PROMPTS[:1], WANTED[:1])


def test_transformers_continuous_reports_token_timestamps(model, greedy):
    finished = []
    with TransformersContinuous(model, block_size=8, num_blocks=32) as manager:
        offline = manager.serve(PROMPTS, WANTED, on_finish=finished.append)
        online = manager.serve(PROMPTS, WANTED, arrival_times=[0.0, 0.1, 0.2, 0.3])
        assert manager.generate(PROMPTS, WANTED) == greedy
    assert [o.output_token_ids for o in offline] == [o.output_token_ids for o in online] == greedy
    assert sum(finished) == 4
    check_timestamps(offline, WANTED)
    check_timestamps(online, WANTED)
    start = online[0].metrics.arrival_time
    for output, delay in zip(online, [0.0, 0.1, 0.2, 0.3], strict=True):
        assert output.metrics.arrival_time == pytest.approx(start + delay)
    assert model.config._attn_implementation == "sdpa"


def test_transformers_continuous_times_tokens_when_generated_not_when_collected(model, monkeypatch):
    """transformers stamps each token as it generates it: a token's time never comes after the result carrying it
    was handed over (stamping on collection would add the polling delay to every token)."""
    with TransformersContinuous(model, block_size=8, num_blocks=32) as hf:
        manager = hf._manager
        add_request, get_result = manager.add_request, manager.get_result
        ids, handed = [], {}  # request id -> (tokens so far, when handed over) per result

        def add(*args, **kwargs):
            ids.append(add_request(*args, **kwargs))
            return ids[-1]

        def get(*args, **kwargs):
            result = get_result(*args, **kwargs)
            if result is not None:
                handed.setdefault(result.request_id, []).append((len(result.generated_tokens), time.perf_counter()))
            return result

        monkeypatch.setattr(manager, "add_request", add)
        monkeypatch.setattr(manager, "get_result", get)
        outputs = hf.serve(PROMPTS, WANTED)
    for request_id, output in zip(ids, outputs, strict=True):
        for position, t in enumerate(output.metrics.token_times):
            assert t <= min(when for count, when in handed[request_id] if count > position)


def test_transformers_continuous_stops_at_its_time_limit_without_finishing_the_rest(model):
    """A benchmark's guard: past time_limit the manager is stopped at once and the tokens so far are counted."""
    prompts, wanted = [[5 + i] * 6 for i in range(4)], [100_000] * 4  # far more than the limit allows
    with TransformersContinuous(model, block_size=8, num_blocks=64, max_num_seqs=4) as manager:
        with pytest.raises(TimeLimitReached) as stopped:
            manager.serve(prompts, wanted, time_limit=0.5)
        assert not manager._manager.is_running()  # stopped, not left to flush 400,000 tokens on exit
    limit = stopped.value
    assert limit.finished == 0 and limit.total == 4 and 0 < limit.tokens < sum(wanted) and limit.seconds >= 0.5
    assert "0 of 4 requests finished" in str(limit)
    with TransformersContinuous(model, block_size=8, num_blocks=16) as manager:
        for bad, error in ((0, ValueError), (float("nan"), ValueError), ("1", TypeError), (True, TypeError)):
            with pytest.raises(error, match="time_limit"):
                manager.serve(PROMPTS, WANTED, time_limit=bad)


def count_forwards(model, monkeypatch):
    """Count the model's forward passes (transformers' manager runs one per step)."""
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs))
    return calls


@pytest.mark.parametrize("where", ["serve", "with"])
def test_ctrl_c_stops_transformers_continuous_without_serving_the_pending_requests(model, monkeypatch, where):
    """Ctrl-C in a serve (or anywhere in the with block) fails the requests still pending: leaving the context
    does not first run them to their 500 tokens, which on a GPU can take minutes."""
    steps = count_forwards(model, monkeypatch)

    def interrupt(count: int) -> None:
        raise KeyboardInterrupt

    runner = TransformersContinuous(model, block_size=8, num_blocks=256, max_num_seqs=4)
    with pytest.raises(KeyboardInterrupt), runner:
        if where == "serve":  # the short first request finishes, and the interrupt comes then
            runner.serve([[5, 6], [7, 8], [9, 10]], [1, 500, 500], on_finish=interrupt)
        runner._manager.add_request([7, 8], max_new_tokens=500, eos_token_id=-1)
        interrupt(0)
    assert len(steps) < 100
    assert model.config._attn_implementation == "sdpa"


def test_a_serve_cut_short_leaves_the_runner_refusing_more_serves(model, monkeypatch):
    """The requests of a serve cut short are failed, not served: the runner says to open a new context instead of
    taking more requests on a stopped manager."""
    monkeypatch.setattr(labkit.serving.baselines, "RESULT_POLL", 0.01)
    hf = TransformersContinuous(model)
    hf._manager = ManagerThatNeverFinishes()
    with pytest.raises(TimeLimitReached):
        hf.serve(PROMPTS, WANTED, time_limit=0.05)
    added = hf._manager.added
    with pytest.raises(RuntimeError, match="leave the with block and open a new one"):
        hf.serve(PROMPTS, WANTED)
    assert hf._manager.added == added


def test_a_serve_takes_only_the_results_of_its_own_requests(model, clock):
    """A result for a request this call did not submit (one of an earlier call) is not this call's to report."""
    script = [(0.25, "req_0", [3], True), (0.5, "req_1", [7, 8], True)]
    hf = TransformersContinuous(model)
    hf._manager = ScriptedManager(clock, script)
    (output,) = hf.serve(PROMPTS[:1], [2])
    assert output.output_token_ids == [7, 8] and output.metrics.token_times == [0.5, 0.5]


def test_transformers_continuous_keeps_the_attention_it_is_given(model, greedy, monkeypatch):
    """Where transformers finds a flash attention it would switch an sdpa model to it (which fails below sm80,
    as on a T4, and may download a kernel): the baseline runs the attention it was given."""
    from transformers.generation.continuous_batching import continuous_api

    for name in ("is_flash_attn_2_available", "is_flash_attn_3_available"):
        monkeypatch.setattr(continuous_api, name, lambda *args, **kwargs: True, raising=False)
    with TransformersContinuous(model, block_size=8, num_blocks=32) as manager:
        assert "flash" not in model.config._attn_implementation
        assert manager.generate(PROMPTS, WANTED) == greedy
    assert model.config._attn_implementation == "sdpa"


def test_transformers_continuous_takes_the_engines_settings_under_transformers_names(model):
    """block_size, num_blocks, max_batch_tokens and max_num_seqs become page_size (block_size before 5.18),
    num_blocks, max_batch_tokens and max_requests_per_batch, by default with EngineConfig's defaults; blocks are
    never shared between requests, as labkit's engine has no prefix caching by default either."""
    default = EngineConfig()
    given = {"block_size": 8, "num_blocks": 40, "max_batch_tokens": 96, "max_num_seqs": 3}
    runs = [({}, (default.block_size, None, default.max_batch_tokens, default.max_num_seqs)), (given, (8, 40, 96, 3))]
    for settings, expected in runs:
        config = TransformersContinuous(model, **settings).batching
        assert (getattr(config, PAGE_SIZE), config.num_blocks, config.max_batch_tokens) == expected[:3]
        assert config.max_requests_per_batch == expected[3] and config.allow_block_sharing is False


@pytest.fixture
def soft_resets(monkeypatch):
    """The ids of the requests transformers soft-resets (drops their cache, re-queues them with their tokens)."""
    from transformers.generation.continuous_batching.requests import RequestState

    reset = RequestState.create_equivalent_initial_request
    ids = []

    def spy(state):
        ids.append(state.request_id)
        return reset(state)

    monkeypatch.setattr(RequestState, "create_equivalent_initial_request", spy)
    return ids


def test_transformers_continuous_timestamps_survive_soft_resets(model, soft_resets):
    """A cache too small for every request at once: transformers soft-resets some, which restarts their
    timestamp lists; the bench must still time every token (once: "returned 40 tokens but 13 timestamps")."""
    prompts, wanted = [[5 + i] * 6 for i in range(4)], [40] * 4
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    expected = [o.output_token_ids for o in Engine(model, EngineConfig(num_blocks=64)).generate(prompts, params)]
    with TransformersContinuous(model, block_size=8, num_blocks=12, max_batch_tokens=64, max_num_seqs=4) as manager:
        outputs = manager.serve(prompts, wanted)
    assert soft_resets  # the cache really was too small
    assert [o.output_token_ids for o in outputs] == expected
    check_timestamps(outputs, wanted)
    for output in outputs:  # scheduled once, before its first token, even when reset later
        assert output.metrics.first_scheduled_time <= output.metrics.first_token_time


def test_transformers_continuous_stops_at_eos_when_asked(model, greedy):
    stop = greedy[1][2]
    with TransformersContinuous(model, block_size=8, num_blocks=32) as manager:
        outputs = manager.serve(PROMPTS, WANTED, eos_token_ids={stop})
    for output, tokens in zip(outputs, greedy, strict=True):
        cut = tokens[: tokens.index(stop) + 1] if stop in tokens else tokens
        assert output.output_token_ids == cut
        assert output.finish_reason == ("stop" if stop in tokens else "length")
        assert len(output.metrics.token_times) == len(cut)
        assert output.metrics.finish_time == output.metrics.token_times[-1]


def test_streamed_chunks_are_stamped_across_a_soft_reset():
    """Stand-in streamed results: after a reset the stamps cover only the tail, and a chunk may hold several tokens."""
    from labkit.serving.baselines import _stamp_new_tokens

    def result(tokens, stamps):
        return types.SimpleNamespace(generated_tokens=tokens, timestamps=stamps)

    times = []
    _stamp_new_tokens(times, result([7], [1.0]), now=1.5)
    _stamp_new_tokens(times, result([7, 8], [1.0, 2.0]), now=2.5)
    _stamp_new_tokens(times, result([7, 8, 9], [3.0]), now=3.5)  # reset after two tokens: a fresh stamp list
    _stamp_new_tokens(times, result([7, 8, 9, 10, 11], [3.0, 4.0, 5.0]), now=5.5)  # two new tokens at once
    assert times == [1.0, 2.0, 3.0, 4.0, 5.0]
    _stamp_new_tokens(times, result([7, 8, 9, 10, 11, 12, 13], []), now=6.5)  # no stamps: the delivery time
    assert times == [1.0, 2.0, 3.0, 4.0, 5.0, 6.5, 6.5]


def test_a_result_without_timestamps_is_stamped_when_it_arrives():
    """A result whose timestamps were not recorded (None, not an empty list) still gets one time per token."""
    from labkit.serving.baselines import _stamp_new_tokens

    times = []
    _stamp_new_tokens(times, types.SimpleNamespace(generated_tokens=[7, 8], timestamps=None), now=1.5)
    assert times == [1.5, 1.5]


def test_bad_baseline_inputs(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        timed_padded_generate(model, PROMPTS, WANTED[:2])
    with pytest.raises(ValueError, match="arrival times"):
        timed_padded_generate(model, PROMPTS, WANTED, arrival_times=[0.0])
    with pytest.raises(ValueError, match=">= 0"):
        timed_padded_generate(model, PROMPTS, WANTED, arrival_times=[0.0, -1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="batch_size"):
        timed_padded_generate(model, PROMPTS, WANTED, batch_size=0)
    for batch_size in (True, 2.0):  # a bool is an int to Python, not a batch size
        with pytest.raises(TypeError, match="batch_size must be an int"):
            timed_padded_generate(model, PROMPTS, WANTED, batch_size=batch_size)
    with pytest.raises(ValueError, match="no prompts"):
        timed_padded_generate(model, [], [])
    with pytest.raises(RuntimeError, match="context manager"):
        TransformersContinuous(model).serve(PROMPTS, WANTED)


# A request due at infinity would be waited for forever, and text would fail deep inside the run: the baselines
# refuse what a WorkloadRequest refuses, naming the request.
@pytest.mark.parametrize(
    ("arrival", "error", "message"),
    [
        (float("inf"), ValueError, r"arrival_times\[1\] must be a finite number of seconds >= 0, got inf"),
        (float("nan"), ValueError, r"arrival_times\[1\] must be a finite number of seconds >= 0, got nan"),
        (-0.5, ValueError, r"arrival_times\[1\] must be a finite number of seconds >= 0, got -0.5"),
        ("0.5", TypeError, r"arrival_times\[1\] must be a number of seconds, got str '0.5'"),
        (True, TypeError, r"arrival_times\[1\] must be a number of seconds, got bool True"),
    ],
)
def test_the_baselines_refuse_an_arrival_time_that_a_workload_request_refuses(
    model, monkeypatch, arrival, error, message
):
    with pytest.raises(error, match=message.replace(r"arrival_times\[1\]", "arrival_time")):
        WorkloadRequest([5], 1, arrival)
    forbid_generate(model, monkeypatch)
    with pytest.raises(error, match=message):
        timed_padded_generate(model, PROMPTS[:2], WANTED[:2], arrival_times=[0.0, arrival])
    hf = TransformersContinuous(model)
    hf._manager = ManagerThatDies()
    with pytest.raises(error, match=message):
        hf.serve(PROMPTS[:2], WANTED[:2], arrival_times=[0.0, arrival])
    assert hf._manager.added == 0


# (prompts, max_new_tokens, error, message): request 1 is the bad one. The model has 1024 token ids, 512 positions.
BAD_REQUESTS = [
    ([[5, 6], [], [7]], [3, 3, 3], ValueError, "request 1: prompt is empty"),
    ([[5, 6], [7, 1024], [7]], [3, 3, 3], ValueError, r"request 1: prompt token id 1024 is outside the vocabulary"),
    ([[5, 6], [7, -1], [7]], [3, 3, 3], ValueError, r"request 1: prompt token id -1 is outside the vocabulary"),
    ([[5, 6], [7, 8.0], [7]], [3, 3, 3], TypeError, "request 1: prompt token ids must be ints, got float 8.0 at"),
    ([[5, 6], 7, [7]], [3, 3, 3], TypeError, "request 1: prompt must be a list of token ids, got int"),
    ([[5, 6], [7] * 513, [7]], [3, 3, 3], ValueError, r"request 1: prompt \(513 tokens\) is longer than the model's"),
    (
        [[5, 6], [7] * 510, [7]],
        [3, 4, 3],
        ValueError,
        r"request 1: prompt \(510 tokens\) \+ max_new_tokens \(4\) exceeds the model's maximum length \(512\)",
    ),
    ([[5, 6], [7], [7]], [3, 0, 3], ValueError, "request 1: max_new_tokens must be >= 1, got 0"),
    ([[5, 6], [7], [7]], [3, 2.0, 3], TypeError, "request 1: max_new_tokens must be an int, got float"),
    ([[5, 6], [7], [7]], [3, True, 3], TypeError, "request 1: max_new_tokens must be an int, got bool"),
]


def forbid_generate(model, monkeypatch):
    """Fail the test if the model runs: a bad request must be refused before."""
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: pytest.fail("the model ran"))


@pytest.mark.parametrize(("prompts", "wanted", "error", "message"), BAD_REQUESTS)
def test_a_static_batch_refuses_a_bad_request_by_its_index_before_the_model_runs(
    model, monkeypatch, prompts, wanted, error, message
):
    forbid_generate(model, monkeypatch)
    with pytest.raises(error, match=message):
        timed_padded_generate(model, prompts, wanted)
    with pytest.raises(error, match=message):
        padded_generate(model, prompts, wanted, batch_size=1)
    if "model's" not in message:  # transformers' manager runs past the model's length (the bench checks it)
        with pytest.raises(error, match=message):  # checked before the manager is asked for
            TransformersContinuous(model).serve(prompts, wanted)


@pytest.mark.parametrize(
    ("pad_token_id", "error", "message"),
    [
        (-1, ValueError, r"pad_token_id -1 is outside the vocabulary \[0, 1024\)"),
        (1024, ValueError, "outside"),
        (None, TypeError, "pad_token_id must be an int, got NoneType"),
        (0.0, TypeError, "got float"),
    ],
)
def test_a_static_batch_refuses_a_pad_token_id_outside_the_vocabulary(model, monkeypatch, pad_token_id, error, message):
    forbid_generate(model, monkeypatch)
    with pytest.raises(error, match=message):
        padded_generate(model, PROMPTS, WANTED, pad_token_id=pad_token_id)


def test_baselines_take_numpy_token_ids(model, greedy):
    prompts = [np.array(p) for p in PROMPTS]
    wanted = [np.int64(n) for n in WANTED]
    outputs = timed_padded_generate(model, prompts, wanted, batch_size=2, pad_token_id=np.int64(0))
    assert [o.output_token_ids for o in outputs] == greedy
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(type(t) is int for o in outputs for t in o.prompt_token_ids)


# What needs no model to see: all but the vocabulary and the length, and a negative id is wrong in any vocabulary.
MODEL_FREE_BAD_REQUESTS = [
    *(case for case in BAD_REQUESTS if "vocabulary" not in case[3] and "model's" not in case[3]),
    ([[5, 6], [7, -1], [7]], [3, 3, 3], ValueError, r"request 1: prompt token id -1 is negative \(position 1\)"),
]


@pytest.mark.parametrize(("prompts", "wanted", "error", "message"), MODEL_FREE_BAD_REQUESTS)
def test_vllm_serve_refuses_what_needs_no_model_to_see_before_importing_vllm(
    monkeypatch, prompts, wanted, error, message
):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if it were not installed: the check comes first
    with pytest.raises(error, match=message):
        vllm_serve(None, prompts, wanted)


class ManagerThatDies:
    """transformers' manager after its background thread died: it takes requests and never posts a result."""

    def __init__(self) -> None:
        self.added = 0
        self.waits: list[float] = []  # how long each get_result was allowed to block
        self.stopped = False  # by a hard stop, which fails the pending requests

    def add_request(self, *args: object, **kwargs: object) -> str:
        self.added += 1
        return f"req_{self.added}"

    def get_result(self, timeout: float) -> None:
        self.waits.append(timeout)
        return None

    def is_running(self) -> bool:
        return False

    def stop(self, block: bool = True, hard_stop: bool = False) -> None:
        self.stopped = hard_stop


def test_a_manager_whose_thread_died_is_noticed_at_once(model, monkeypatch):
    """Waiting for results checks that the manager still runs, instead of blocking for RESULT_TIMEOUT."""
    monkeypatch.setattr(labkit.serving.baselines, "RESULT_POLL", 0.01)
    hf = TransformersContinuous(model)
    hf._manager = ManagerThatDies()
    with pytest.raises(RuntimeError, match="stopped before finishing all requests"):
        hf.serve(PROMPTS, WANTED)
    assert hf._manager.added == len(PROMPTS)
    assert max(hf._manager.waits) <= 0.01  # never one long block that a dead thread would never end


class ManagerThatNeverFinishes(ManagerThatDies):
    """A manager that runs on without a result: only a time limit ends a run on it (or, after 100 polls, its thread
    dies, so that a run that misses its limit fails instead of hanging)."""

    def get_result(self, timeout: float) -> None:
        time.sleep(timeout)
        return super().get_result(timeout)

    def is_running(self) -> bool:
        return not self.stopped and len(self.waits) < 100


def test_generate_passes_its_time_limit_on(model, monkeypatch):
    monkeypatch.setattr(labkit.serving.baselines, "RESULT_POLL", 0.01)
    hf = TransformersContinuous(model)
    hf._manager = ManagerThatNeverFinishes()
    with pytest.raises(TimeLimitReached, match="0 of 4 requests finished"):
        hf.generate(PROMPTS, WANTED, time_limit=0.05)
    assert hf._manager.stopped  # at once, without finishing the rest


def test_a_time_limit_is_kept_while_later_requests_are_not_yet_due(model, monkeypatch):
    """Waiting for the next arrival checks the limit and polls in short waits: a run cannot overshoot by a long gap."""
    monkeypatch.setattr(labkit.serving.baselines, "RESULT_POLL", 0.01)
    hf = TransformersContinuous(model)
    hf._manager = ManagerThatNeverFinishes()
    with pytest.raises(TimeLimitReached):
        hf.serve(PROMPTS, WANTED, arrival_times=[0.0, 0.0, 0.0, 5.0], time_limit=0.05)
    assert hf._manager.added == 3 and hf._manager.stopped  # stopped before the last request was due
    assert max(hf._manager.waits) <= 0.01


class ScriptedManager(ManagerThatNeverFinishes):
    """transformers' manager on a stand-in clock: it posts scripted results, each at its time; get_result hands
    over the next one posted by the end of its wait (moving the clock on to it), or waits its timeout out."""

    def __init__(self, clock: types.SimpleNamespace, script: list[tuple[float, str, list[int], bool]]) -> None:
        super().__init__()
        self.clock = clock
        self.script = sorted(script, key=lambda posted: posted[0])  # (time, request id, tokens so far, finished)
        self.stamps: dict[str, list[float]] = {}  # each request's token times so far, as transformers records them

    def get_result(self, timeout: float) -> types.SimpleNamespace | None:
        self.waits.append(timeout)
        if not self.script or self.script[0][0] > self.clock.now + timeout:
            self.clock.now += timeout
            return None
        when, request_id, tokens, finished = self.script.pop(0)
        self.clock.now = max(self.clock.now, when)
        stamps = self.stamps.setdefault(request_id, [])
        stamps += [when] * (len(tokens) - len(stamps))
        return types.SimpleNamespace(
            request_id=request_id,
            error=None,
            lifespan=(stamps[0] - 0.125, -1),  # scheduled an eighth of a second before its first token
            generated_tokens=list(tokens),
            timestamps=list(stamps),
            is_finished=lambda: finished,
        )


@pytest.fixture
def clock(monkeypatch):
    """A stand-in clock for the baselines, at 0 when a run starts; only a ScriptedManager moves it on."""
    now = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(labkit.serving.baselines, "time", types.SimpleNamespace(perf_counter=lambda: now.now))
    monkeypatch.setattr(labkit.serving.baselines, "RESULT_POLL", 0.25)
    return now


def test_a_time_limit_counts_the_results_already_out_when_it_stops(model, clock):
    """A step posts the results of all its requests at once: past the limit, those already out are taken before
    stopping, not only the first of them. (The limit is passed only once it is past: at 1.0 s the run goes on.)"""
    script = [(0.5, f"req_{i}", [7], False) for i in (1, 2, 3, 4)]  # the first step, well within the limit
    script += [(1.125, f"req_{i}", [7, 8, 9], i == 1) for i in (2, 3, 4, 1)]  # the next one, just past it
    hf = TransformersContinuous(model)
    hf._manager = ScriptedManager(clock, script)
    with pytest.raises(TimeLimitReached) as stopped:
        hf.serve(PROMPTS, WANTED, time_limit=1.0)  # req_1 wants 3 tokens, the others more
    limit = stopped.value
    assert (limit.finished, limit.total, limit.tokens, limit.seconds) == (1, 4, 12, 1.125)
    assert hf._manager.stopped and hf._manager.script == []


def test_the_result_timeout_counts_from_the_last_result_not_from_the_start(model, clock, monkeypatch):
    """A run may last longer than RESULT_TIMEOUT while results keep coming; a silence longer than it fails the run
    at the first poll past it."""
    monkeypatch.setattr(labkit.serving.baselines, "RESULT_TIMEOUT", 1.0)
    tokens = [7, 8, 9, 10]
    hf = TransformersContinuous(model)
    hf._manager = ScriptedManager(clock, [(0.75 * n, "req_1", tokens[:n], n == 4) for n in (1, 2, 3, 4)])
    (output,) = hf.serve(PROMPTS[:1], [4])
    assert output.output_token_ids == tokens and output.metrics.token_times == [0.75, 1.5, 2.25, 3.0]
    assert output.metrics.first_scheduled_time == 0.625 and output.metrics.arrival_time == 0.0
    assert clock.now == 3.0

    clock.now = 0.0
    hf._manager = ScriptedManager(clock, [(0.75, "req_1", tokens[:1], False)])  # then nothing
    with pytest.raises(RuntimeError, match=r"returned nothing for 1\.0 s"):
        hf.serve(PROMPTS[:1], [4])
    assert clock.now == 2.0  # polled every 0.25 s: 1.75 is not yet more than 1.0 s after the result at 0.75


def test_results_that_come_while_a_later_request_is_not_yet_due_are_taken_then(model, clock):
    """The first request finishes before the second one is due: its results are taken while waiting, and the
    second is submitted when due, no later (the stand-in clock makes that exact)."""
    script = [(0.5, "req_1", [7], False), (0.75, "req_1", [7, 8], True), (1.5, "req_2", [9], True)]
    hf = TransformersContinuous(model)
    hf._manager = ScriptedManager(clock, script)
    first, second = hf.serve(PROMPTS[:2], [2, 1], arrival_times=[0.0, 0.875])
    assert first.output_token_ids == [7, 8] and first.metrics.token_times == [0.5, 0.75]
    assert second.output_token_ids == [9] and second.metrics.token_times == [1.5]
    assert (first.metrics.arrival_time, second.metrics.arrival_time) == (0.0, 0.875)
    assert hf._manager.waits[:4] == [0.25, 0.25, 0.25, 0.125]  # waiting for the second: none past when it is due


def test_transformers_continuous_submits_requests_in_arrival_order_not_input_order(model, greedy):
    """The request listed second arrives first: it is submitted then, not after the other one's later arrival."""
    with TransformersContinuous(model, block_size=8, num_blocks=32) as manager:
        outputs = manager.serve(PROMPTS[:2], WANTED[:2], arrival_times=[0.2, 0.0])
    assert [o.output_token_ids for o in outputs] == greedy[:2]
    late, early = outputs[0].metrics, outputs[1].metrics
    assert early.first_scheduled_time < late.arrival_time <= late.first_scheduled_time


class SwitchingContext:
    """Stand-in for transformers' manager context: entering switches the model to paged attention, for good
    (an attention already named paged, as labkit names it for older transformers, stays as it is)."""

    def __init__(self, model, fail):
        self.model, self.fail = model, fail

    def __enter__(self):
        config = self.model.config
        if not config._attn_implementation.startswith("paged|"):
            config._attn_implementation = f"paged|{config._attn_implementation}"
        if self.fail:
            raise RuntimeError("the manager failed to start")
        return ManagerThatDies()

    def __exit__(self, *exc_info):
        return None


@pytest.mark.parametrize("fails", [False, True], ids=["after the run", "after a failed start"])
def test_the_model_gets_back_the_attention_it_had_when_the_manager_started(model, monkeypatch, fails):
    """Whatever transformers leaves switched, the model leaves with its own attention: the one it had on entering,
    even if it changed after the baseline was built."""
    hf = TransformersContinuous(model)
    monkeypatch.setattr(model, "continuous_batching_context_manager", lambda **kwargs: SwitchingContext(model, fails))
    model.set_attn_implementation("eager")
    try:
        if fails:
            with pytest.raises(RuntimeError, match="failed to start"), hf:
                pass
        else:
            with hf:
                assert model.config._attn_implementation == "paged|eager"
        assert model.config._attn_implementation == "eager"
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize(
    ("version", "has_psutil", "refused"), [("5.17.0", False, True), ("5.17.0", True, False), ("5.21.0", False, False)]
)
def test_an_older_transformers_on_a_cpu_needs_psutil_to_size_its_cache(
    model, monkeypatch, version, has_psutil, refused
):
    """transformers 5.15-5.20 would otherwise read 0 bytes free and refuse every cache with a MemoryError."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(transformers, "__version__", version)
    # transformers calls find_spec too (with a package argument, the first time it looks for a library).
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: find_spec(name, *args) if name != "psutil" or has_psutil else None,
    )
    if refused:
        with pytest.raises(RuntimeError, match=r"transformers 5\.17\.0 .* pip install psutil"):
            TransformersContinuous(model)
    else:
        TransformersContinuous(model)


def test_every_mode_serves_the_same_tokens_and_is_measured_alike(model):
    config = EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=128, max_num_seqs=4)
    workload = make_workload("uniform", 6, prompt_len=(4, 12), output_len=(2, 8), vocab_size=256, special_ids=(0, 1, 2))
    modes = ["labkit-continuous", "labkit-static", "hf-generate", "hf-continuous"]
    finished = []
    setup = BenchSetup(model, None, config, progress=finished.append, static_batch_size=3)
    results = run_bench(setup, workload, modes)
    assert sum(finished) == 6 * len(modes)
    tokens = [[o.output_token_ids for o in r.run.outputs] for r in results]
    assert all(t == tokens[0] for t in tokens)
    assert [len(t) for t in tokens[0]] == [r.max_new_tokens for r in workload]
    for result in results:
        assert result.metrics == run_metrics(*result.run)
        assert result.metrics.ttft is not None and result.metrics.tpot is not None
    data = results_json(results, {})
    for run in data["runs"]:
        assert len(run["requests"]) == 6
        assert all(len(r["token_times"]) == r["num_output_tokens"] for r in run["requests"])
        assert (run["steps"] == []) == (run["mode"] in ("hf-generate", "hf-continuous"))
    # The static modes batch 3 requests (static_batch_size); the continuous ones run up to max_num_seqs.
    running = {run["mode"]: max(s["num_running"] for s in run["steps"]) for run in data["runs"] if run["steps"]}
    assert running == {"labkit-continuous": 4, "labkit-static": 3}


def test_load_model_goes_through_labkit_models(monkeypatch):
    calls = []

    def fake_load(name, device, dtype):
        calls.append((name, device.type, dtype))
        return "model", "tokenizer"

    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model("no-such-model", EngineConfig(device="cpu"))
    monkeypatch.setattr("labkit.models.load", fake_load)
    assert load_model("tiny-shakespeare", EngineConfig(device="cpu")) == ("model", "tokenizer")
    assert load_model("./some/dir", EngineConfig(device="cpu", dtype="bfloat16")) == ("model", "tokenizer")
    assert calls == [("tiny-shakespeare", "cpu", torch.float32), ("./some/dir", "cpu", torch.bfloat16)]


def test_text_workloads_use_the_models_tokenizer(monkeypatch, tmp_path, capsys):
    seen = {}
    real_make_workload = labkit.serving.bench.cli.make_workload

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real_make_workload(*args, **kwargs)

    monkeypatch.setattr(labkit.serving.bench.cli, "make_workload", spy)
    argv = ["--model", "tiny-shakespeare", "--workload", "uniform", "--num-requests", "3", "--threads", "1"]
    argv += ["--prompt-len", "4,8", "--output-len", "2,3", "--modes", "labkit-continuous", "--no-progress"]
    assert main(argv) == 0
    assert Path(seen["tokenizer"].name_or_path).name == "tiny_shakespeare"  # the bundled model's own tokenizer
    assert "vocab_size" not in seen
    assert "torch threads: 1" in capsys.readouterr().out


def test_vllm_mode_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if it were not installed
    assert main(["--model", "random:tiny", "--modes", "vllm", "--num-requests", "2"]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err and "pip install vllm" in err and "Traceback" not in err


def test_vllm_serve_timestamps_every_step(monkeypatch):
    """A stand-in vLLM engine: each step gives every unfinished request one new token (DELTA outputs)."""

    class Engine:
        def __init__(self):
            self.requests = {}

        def add_request(self, request_id, prompt, params):
            assert params.output_kind == "delta" and params.temperature == 0.0
            self.requests[request_id] = [prompt["prompt_token_ids"], params.max_tokens, 0]

        def has_unfinished_requests(self):
            return bool(self.requests)

        def step(self):
            outputs = []
            for request_id, state in list(self.requests.items()):
                prompt, wanted, done = state
                state[2] = done + 1
                finished = state[2] == wanted
                completion = types.SimpleNamespace(token_ids=[prompt[0] + done], finish_reason="length")
                outputs.append(types.SimpleNamespace(request_id=request_id, outputs=[completion], finished=finished))
                if finished:
                    del self.requests[request_id]
            return outputs

    def sampling_params(**kwargs):
        return types.SimpleNamespace(**kwargs)

    fake = types.ModuleType("vllm")
    fake.SamplingParams = sampling_params
    fake_params = types.ModuleType("vllm.sampling_params")
    fake_params.RequestOutputKind = types.SimpleNamespace(DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake_params)
    llm = types.SimpleNamespace(llm_engine=Engine())
    finished = []
    outputs = vllm_serve(llm, [[10, 1], [20, 2, 3]], [3, 2], on_finish=finished.append)
    assert [o.output_token_ids for o in outputs] == [[10, 11, 12], [20, 21]]
    assert sum(finished) == 2
    for output, n in zip(outputs, [3, 2], strict=True):
        m = output.metrics
        assert len(m.token_times) == n and m.token_times == sorted(m.token_times)
        assert m.first_token_time == m.token_times[0] and m.finish_time == m.token_times[-1]
        assert m.first_scheduled_time is None  # vLLM's queueing is not visible from outside
    assert outputs[0].metrics.token_times[:2] == outputs[1].metrics.token_times  # the same two steps


@pytest.fixture
def fake_cpu_vllm(monkeypatch):
    """A stand-in for vLLM's CPU build: its LLM records how it was built, then stops the run."""
    built = []

    class LLM:
        def __init__(self, **kwargs):
            built.append(kwargs)
            raise RuntimeError("stand-in vLLM stops here")

    fake = types.ModuleType("vllm")
    fake.LLM = LLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    labkit.serving.bench.modes._vllm_llm.cache_clear()
    yield built
    labkit.serving.bench.modes._vllm_llm.cache_clear()


def test_vllm_on_a_cpu_needs_blocks_of_32(fake_cpu_vllm, capsys):
    assert main(["--model", "tiny-shakespeare", "--modes", "vllm", "--num-requests", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "needs --block-size a multiple of 32, not 16" in err and "Traceback" not in err
    assert fake_cpu_vllm == []  # refused before anything ran


def test_vllm_gets_the_same_dtype_and_cache_as_labkit(fake_cpu_vllm):
    from labkit.models import BUNDLED_DIR, load

    model, tokenizer = load("tiny-shakespeare")
    config = EngineConfig(block_size=32, max_batch_tokens=256, max_num_seqs=8, device="cpu")
    setup = BenchSetup(model, tokenizer, config, model_name="tiny-shakespeare")
    workload = make_workload(
        "uniform", 4, prompt_len=(20, 40), output_len=(5, 9), vocab_size=256, special_ids=(0, 1, 2)
    )
    (result,) = run_bench(setup, workload, ["vllm"])
    assert result.failed and "RuntimeError: stand-in vLLM stops here" in result.error  # recorded, not raised
    (kwargs,) = fake_cpu_vllm
    labkit_cache = Engine(model, config).runner.cache.data
    per_block = labkit_cache[:, :, :, 0].nbytes  # one block of every layer's K and V
    assert kwargs["kv_cache_memory_bytes"] == (labkit_cache.shape[3] - 1) * per_block  # minus labkit's scratch block
    assert (kwargs["model"], kwargs["dtype"]) == (str(BUNDLED_DIR), "float32")
    assert (kwargs["block_size"], kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]) == (32, 8, 256)
    # The context the workload needs, in whole blocks, not the model's full one.
    longest = max(len(r.prompt) + r.max_new_tokens for r in workload)
    assert kwargs["max_model_len"] % 32 == 0 and longest <= kwargs["max_model_len"] < longest + 32
    assert kwargs["max_model_len"] < model.config.max_position_embeddings


def test_vllm_is_refused_up_front_when_the_kv_budget_cannot_hold_its_context(fake_cpu_vllm, capsys):
    argv = ["--model", "tiny-shakespeare", "--modes", "vllm", "--block-size", "32", "--num-blocks", "2"]
    argv += ["--workload", "uniform", "--num-requests", "3", "--prompt-len", "40,50", "--output-len", "30,30"]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "mode 'vllm' cannot serve this workload: vLLM needs room for one request of max_model_len" in err
    assert "labkit's KV-cache budget holds 64" in err and "Traceback" not in err
    assert fake_cpu_vllm == []  # refused before vLLM was started


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--modes", "hf-generate", "--prompt-len", "2045,2047"], "exceeds the model's maximum length (2048)"),
        (["--modes", "hf-continuous", "--num-blocks", "2"], "cache slots, but the cache holds 32 (2 blocks x 16)"),
        (["--modes", "labkit-continuous", "hf-continuous", "--num-blocks", "2"], "the whole KV cache holds 32"),
    ],
)
def test_baselines_refuse_what_they_could_not_finish_before_running(options, message, monkeypatch, capsys):
    ran = []
    for mode in ("labkit-continuous", "hf-generate", "hf-continuous"):
        monkeypatch.setitem(labkit.serving.bench.modes.MODES, mode, lambda workload, setup, mode=mode: ran.append(mode))
    argv = ["--model", "random:tiny", "--workload", "uniform", "--num-requests", "3", "--output-len", "8,16"]
    assert main([*argv, "--threads", "1", "--no-progress", *options]) == 2
    err = capsys.readouterr().err
    assert "cannot serve this workload: request" in err and message in err and "Traceback" not in err
    assert ran == []


@pytest.mark.parametrize(
    ("options", "faster", "note"),
    [
        ([], True, ", labkit linears oneDNN-packed"),
        ([], False, ", labkit linears nn.Linear (oneDNN-packed measured slower here)"),
        (["--no-pack-weights"], True, ""),
    ],
)
def test_header_says_whether_labkit_runs_packed_weights(options, faster, note, monkeypatch, capsys):
    """By default packing is measured on the model; the header says what the labkit modes will run."""
    from labkit.runtime.packed import PackedLinears

    monkeypatch.setattr(PackedLinears, "faster_than_linear", lambda self: faster)
    argv = ["--model", "random:tiny", "--workload", "uniform", "--num-requests", "2", "--prompt-len", "4,8"]
    argv += ["--output-len", "2,3", "--threads", "1", "--no-progress", "--modes", "labkit-continuous", *options]
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("random:tiny on cpu (") and header.endswith(f"float32, torch threads: 1{note}")


def test_a_run_whose_last_results_are_out_by_the_time_limit_is_complete(model, clock):
    """The results taken when the limit is found passed finish every request: the run returns its outputs, timed
    as they came, instead of reporting a time limit that cut nothing short."""
    script = [(0.5, f"req_{i}", [7], False) for i in (1, 2, 3, 4)]
    script += [(1.125, f"req_{i}", [7, 8], True) for i in (1, 2, 3, 4)]
    hf = TransformersContinuous(model)
    hf._manager = ScriptedManager(clock, script)
    outputs = hf.serve(PROMPTS, [2, 2, 2, 2], time_limit=1.0)
    assert [o.output_token_ids for o in outputs] == [[7, 8]] * 4
    assert all(o.metrics.token_times == [0.5, 1.125] for o in outputs)
    assert not hf._manager.stopped
