"""The failure contract at the edges: a bad value is refused with an error that names it, before it can stall,
hang or leak; and what a serving loop needs to run for ever (release, no stray threads) is there.

Threads: torch runs on 1 thread.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.core.request import FINISH_REASONS, Request, RequestMetrics, RequestOutput, RequestState
from labkit.core.scheduler import Scheduler, SchedulerOutput
from labkit.serving.metrics import parse_targets
from labkit.serving.online import run_workload
from labkit.serving.workloads import WorkloadRequest, make_workload

torch.set_num_threads(1)

CONFIG = EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=32)
GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def sim_engine(**parts) -> Engine:
    return Engine(SimulatedModel(), CONFIG, **parts)


def test_a_huge_top_k_keeps_every_token_and_the_others_are_served(tiny_model):
    model = tiny_model("llama")
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=64))
    alone = Engine(model, EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=64))
    huge, off = (SamplingParams(max_new_tokens=4, temperature=0.7, top_k=k, seed=3) for k in (10**400, 0))
    greedy, sampled = engine.generate([[5, 6, 7], [8, 9]], [GREEDY, huge])
    assert greedy.output_token_ids == alone.generate([[5, 6, 7]], GREEDY)[0].output_token_ids
    assert sampled.output_token_ids == alone.generate([[8, 9]], off)[0].output_token_ids  # as with no top-k
    assert engine.num_free_blocks == engine.num_blocks


class PlansNothing(Scheduler):
    """A learner's scheduler that never schedules anything: every step is empty."""

    def schedule_continuous(self) -> SchedulerOutput:
        return SchedulerOutput(step=self.step_index + 1, chunks=[])


def test_generate_and_the_online_driver_stop_when_nothing_can_ever_run():
    engine = sim_engine(scheduler_cls=PlansNothing)
    with pytest.raises(RuntimeError, match="scheduled nothing"):
        engine.generate([[5, 6, 7]], GREEDY)
    assert not engine.requests and not engine.scheduler.has_unfinished()
    assert list(engine.step().finished.values()) == ["abort"] and not engine.has_unfinished()
    with pytest.raises(RuntimeError, match="scheduled nothing"):
        run_workload(engine, [WorkloadRequest([5, 6, 7], 4)])
    assert not engine.requests and engine.num_free_blocks == engine.num_blocks


def test_a_config_cannot_change_under_an_engine():
    config = EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_batch_tokens = 0
    with pytest.raises(ValueError, match="max_batch_tokens"):
        dataclasses.replace(config, max_batch_tokens=0)  # a changed copy is checked again
    with pytest.raises(ValueError, match=r"max_num_seqs \(32\) must be <= max_batch_tokens \(8\).*set both"):
        dataclasses.replace(config, max_batch_tokens=8)  # max_num_seqs was derived from the old budget
    assert dataclasses.replace(config, max_batch_tokens=8, max_num_seqs=None).max_num_seqs == 8


def test_a_cache_too_big_to_allocate_is_refused_and_the_model_is_left_as_it_was(tiny_model):
    model = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"100,000,000,000 blocks .* set a smaller num_blocks"):
        Engine(model, EngineConfig(dtype="float32", num_blocks=10**11))
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("config", "parts", "error"),
    [
        ({"dtype": "float32", "attention_backend": "triton"}, {"slot_mapping_fn": lambda *a: []}, ValueError),
        ({"dtype": "float32"}, {"attention_fn": "sdpa"}, TypeError),
    ],
)
def test_a_refused_engine_leaves_the_model_as_it_was(tiny_model, config, parts, error):
    model = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(error):
        Engine(model, EngineConfig(num_blocks=8, **config), **parts)
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("arch", "settings", "slides"),
    [
        ("mistral", {"sliding_window": 8}, True),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, True),
        ("qwen2", {}, False),
        ("llama", {}, False),
    ],
)
def test_an_attention_fn_for_a_sliding_window_model_is_refused_when_the_engine_is_built(
    tiny_model, arch, settings, slides
):
    def attend(query, keys, values, scale):  # never called: the whole context, where the model wants a window
        raise AssertionError

    model = tiny_model(arch, **settings)
    if slides:
        with pytest.raises(ValueError, match="this model uses a sliding window"):
            Engine(model, EngineConfig(num_blocks=8), attention_fn=attend)
    else:
        assert Engine(model, EngineConfig(num_blocks=8), attention_fn=attend).runner.attention_fn is attend


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"arrival_time": float("nan")}, ValueError, "arrival_time must be a finite"),
        ({"arrival_time": -1.0}, ValueError, "arrival_time must be a finite"),
        ({"arrival_time": "1"}, TypeError, "arrival_time must be a number"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": 2.0}, TypeError, "max_new_tokens must be an int"),
        ({"prompt": 5}, TypeError, "prompt must be"),
    ],
)
def test_a_workload_request_names_its_bad_field(fields, error, message):
    with pytest.raises(error, match=message):
        WorkloadRequest(**({"prompt": [5, 6], "max_new_tokens": 4} | fields))


def test_a_workload_request_stores_plain_numbers():
    request = WorkloadRequest([5, 6], np.int64(4), np.float32(0.5))
    assert type(request.max_new_tokens) is int and type(request.arrival_time) is float


def test_run_workload_names_a_workload_that_is_not_a_list():
    with pytest.raises(TypeError, match="workload must be a list of WorkloadRequest"):
        run_workload(sim_engine(), 5)


def test_release_returns_a_finished_output_once_and_refuses_a_running_request():
    engine = sim_engine()
    request_id = engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="has not finished"):
        engine.release(request_id)
    while engine.has_unfinished():
        engine.step()
    output = engine.release(request_id)
    assert len(output.output_token_ids) == 4 and output.finish_reason == "length"
    assert request_id not in engine.requests
    with pytest.raises(KeyError):
        engine.release(request_id)


def test_a_request_id_is_an_int_of_any_kind_never_a_bool_or_a_float():
    """True and 1.0 equal 1, so a lookup by either would act on request 1; numpy's integers are request ids."""
    engine = sim_engine()
    ids = [engine.add_request([5, 6, 7], GREEDY) for _ in range(2)]
    for call in (engine.abort, engine.release, engine.output):
        for bad in (True, 1.0):
            with pytest.raises(TypeError, match=f"request_id must be an int, got {type(bad).__name__} {bad!r}"):
                call(bad)
    assert engine.requests[ids[1]].finish_reason is None, "a refused id touched request 1"
    assert engine.output(np.int64(ids[1])).request_id == ids[1]
    engine.abort(np.int64(ids[1]))
    while engine.has_unfinished():
        engine.step()
    output = engine.release(np.int64(ids[1]))
    assert output.finish_reason == "abort" and type(output.request_id) is int


def test_release_waits_for_the_last_token_under_async_scheduling():
    engine = Engine(SimulatedModel(), dataclasses.replace(CONFIG, async_scheduling=True))
    request_id = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=1, ignore_eos=True))
    engine._launch(keep_empty=False)  # committed (finished by length), its one token not yet read
    with pytest.raises(ValueError, match="has not finished"):
        engine.release(request_id)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.release(request_id).output_token_ids) == 1


def test_a_progress_bar_leaves_no_thread_behind():
    before = set(threading.enumerate())
    sim_engine().generate([[5, 6, 7]] * 3, GREEDY, progress=True)
    run_workload(sim_engine(), [WorkloadRequest([5, 6, 7], 4)], progress=True)
    assert set(threading.enumerate()) <= before


@pytest.mark.parametrize(("prompt_len", "max_new_tokens"), [(5, 4), (8, 1)])
def test_a_request_that_just_fits_the_model_length_is_served(prompt_len, max_new_tokens):
    # The last generated token is never fed back: prompt + max_new_tokens - 1 positions are all it needs.
    engine = Engine(SimulatedModel(max_model_len=8), CONFIG)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    (output,) = engine.generate([[5] * prompt_len], params)
    assert len(output.output_token_ids) == max_new_tokens and output.finish_reason == "length"
    with pytest.raises(ValueError, match="maximum length"):
        engine.add_request([5] * prompt_len, dataclasses.replace(params, max_new_tokens=max_new_tokens + 1))
    with pytest.raises(ValueError, match="maximum length"):
        engine.add_request([5] * 9, SamplingParams(max_new_tokens=1))


def test_a_request_refused_for_the_cache_size_takes_no_request_id():
    engine = sim_engine()  # 32 blocks x 4 = 128 slots
    first = engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="whole KV cache"):
        engine.add_request([5] * 126, GREEDY)
    assert engine.add_request([5, 6, 7], GREEDY) == first + 1
    assert set(engine.requests) == {first, first + 1}


def test_generate_s_progress_bar_counts_every_request_and_is_closed(monkeypatch):
    bars = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            self.total, self.done, self.closed = total, 0, False
            bars.append(self)

        def update(self, n: int) -> None:
            self.done += n

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr("labkit.core.engine.progress_bar", Bar)
    sim_engine().generate([[5, 6, 7], [8, 9], [10]], GREEDY, progress=True)
    (bar,) = bars
    assert (bar.total, bar.done, bar.closed) == (3, 3, True)


def test_numpy_token_ids_are_served_as_ints():
    engine = sim_engine()
    (numpy_ids,) = engine.generate([list(np.array([5, 6, 7]))], GREEDY)  # elements are np.int64
    (plain,) = sim_engine().generate([[5, 6, 7]], GREEDY)
    assert numpy_ids.output_token_ids == plain.output_token_ids
    assert all(type(t) is int for t in numpy_ids.prompt_token_ids)


def test_a_prompt_mixing_numpy_and_python_ints_is_stored_as_ints():
    (output,) = sim_engine().generate([[5, np.int64(6), 7]], GREEDY)
    assert output.prompt_token_ids == [5, 6, 7] and all(type(t) is int for t in output.prompt_token_ids)


def test_every_token_id_of_the_vocabulary_is_a_valid_prompt_token():
    engine = sim_engine()
    vocab = engine.runner.vocab_size
    (output,) = engine.generate([[0, 5, vocab - 1]], GREEDY)  # 0 and vocab - 1 are the edges, both inside
    assert output.prompt_token_ids == [0, 5, vocab - 1] and len(output.output_token_ids) == 4
    for token in (-1, vocab):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([5, token], GREEDY)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: sim_engine().generate([[5]], 5), TypeError, "params must be a SamplingParams or a list"),
        (lambda: sim_engine(allocator_cls=int), TypeError, "allocator_cls must be a subclass of BlockAllocator"),
        (lambda: sim_engine(scheduler_cls=dict), TypeError, "scheduler_cls must be a subclass of Scheduler"),
        (lambda: make_workload("uniform", 3, vocab_size=100, special_ids=None), TypeError, "special_ids must be"),
        (lambda: make_workload("uniform", 3, vocab_size=100, special_ids="ab"), TypeError, "special_ids must be"),
        (lambda: make_workload("uniform", 3, vocab_size=100, seed=-1), ValueError, "seed must be >= 0"),
        (lambda: make_workload("uniform", 3, tokenizer=object()), TypeError, "tokenizer must have an encode"),
        (lambda: make_workload("uniform", 3, vocab_size=100, rate=1e-320), ValueError, "rate 1e-320 is too small"),
        (lambda: parse_targets("ttft<=1e400"), ValueError, "finite number of seconds"),
        (lambda: parse_targets("ttft<=5,ttft<=3"), ValueError, "given twice"),
        (lambda: SimulatedModel(vocab_size=2500.5), TypeError, "vocab_size must be an int"),
        (lambda: SimulatedModel(cost=5), TypeError, "cost must be a preset name or a CostModel"),
        (lambda: SimulatedModel(mean_output_len=float("nan")), ValueError, "mean_output_len must be a finite"),
    ],
)
def test_bad_values_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize(("text", "seconds"), [("ttft<=5.", 5.0), ("ttft<=.5", 0.5), ("tpot<=50ms", 0.05)])
def test_targets_take_every_way_of_writing_a_number(text, seconds):
    assert list(parse_targets(text).values()) == [pytest.approx(seconds)]


@pytest.mark.parametrize("stop", ["ab", b"\x05\x06", 5])
def test_stop_token_ids_must_be_a_sequence_of_ints(stop):
    # Bytes iterate as ints, so b"\x05\x06" would otherwise pass silently as the token ids (5, 6).
    with pytest.raises(TypeError, match="stop_token_ids must be a sequence of ints"):
        SamplingParams(stop_token_ids=stop)


def test_sampling_params_are_immutable_values_and_say_whether_they_are_greedy():
    """One SamplingParams may be shared by many requests: it cannot change under them, and it is a hashable value."""
    params = SamplingParams(temperature=0.7, top_k=5, stop_token_ids=[3, 4])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.0
    assert {params: 1}[SamplingParams(temperature=0.7, top_k=5, stop_token_ids=(3, 4))] == 1
    assert SamplingParams().greedy is True
    assert SamplingParams(temperature=1e-30).greedy is False


def test_requests_are_distinct_by_identity():
    """Two requests with the same fields are still two requests: the queues remove and look up the one they hold."""
    params = SamplingParams()
    first, second = Request(0, [5, 6], params), Request(0, [5, 6], params)
    assert first != second
    assert len({first, second}) == 2
    assert [first, second].index(second) == 1


def test_a_request_counts_its_prompt_and_output_tokens():
    request = Request(0, [5, 6, 7], SamplingParams())
    assert (request.num_prompt_tokens, request.num_tokens) == (3, 3)
    request.output_token_ids += [8, 9]
    assert (request.num_prompt_tokens, request.num_tokens) == (3, 5)
    assert request.metrics.arrival_time == 0.0  # made without metrics: it arrived at the clock's origin
    assert Request(1, [5], SamplingParams()).metrics is not request.metrics


def test_request_tokens_is_a_slice_of_prompt_plus_output():
    request = Request(0, [1, 2, 3], SamplingParams())
    request.output_token_ids += [10, 11, 12, 13, 14, 15, 16]
    everything = request.prompt_token_ids + request.output_token_ids
    for start in range(len(everything) + 1):
        for end in range(start, len(everything) + 1):
            assert request.tokens(start, end) == everything[start:end], (start, end)
            assert [request.token_at(i) for i in range(start, end)] == everything[start:end]


def test_an_output_is_finished_once_it_has_a_finish_reason():
    metrics = RequestMetrics(arrival_time=0.0)
    assert not RequestOutput(0, [5], [], None, None, metrics).finished
    for reason in FINISH_REASONS:
        assert RequestOutput(0, [5], [6], None, reason, metrics).finished


def test_a_request_is_finished_only_in_the_finished_state():
    request = Request(0, [5, 6], SamplingParams())
    for state in RequestState:
        request.state = state
        assert request.is_finished is (state is RequestState.FINISHED)


def test_numpy_flags_and_integers_are_taken_and_stored_as_python_ones():
    """numpy's bool is no subclass of bool, nor its integers of int, and learners' sizes often come out of numpy."""
    params = SamplingParams(ignore_eos=np.bool_(True), max_new_tokens=np.int64(4))
    assert params.ignore_eos is True
    ints = {"block_size": np.int32(4), "num_blocks": np.int64(16), "max_batch_tokens": np.uint16(32), "max_num_seqs": 4}
    flags = ("chunked_prefill", "enable_prefix_caching", "async_scheduling", "pack_weights", "use_cuda_graph")
    config = EngineConfig(**ints, **{flag: np.bool_(flag != "use_cuda_graph") for flag in flags})
    assert all(type(getattr(config, name)) is int for name in ints)
    assert [getattr(config, flag) for flag in flags] == [True, True, True, True, False]
    assert all(type(getattr(config, flag)) is bool for flag in flags)
    model = SimulatedModel(vocab_size=np.int64(64), seed=np.uint8(3), default_num_blocks=np.int16(8))
    assert type(model.vocab_size) is type(model.seed) is type(model.default_num_blocks) is int
    assert type(SimulatedModel(mean_output_len=np.float32(6.5)).mean_output_len) is float  # numpy's floats too
    (output,) = Engine(model, config).generate([[5, 6, 7]], params)
    assert len(output.output_token_ids) == 4


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: SamplingParams(ignore_eos=np.int64(1)), "ignore_eos must be a bool, got int64"),
        (lambda: SamplingParams(ignore_eos=np.array([True])), "ignore_eos must be a bool, got ndarray"),
        (lambda: EngineConfig(async_scheduling=1), "async_scheduling must be a bool, got int"),
        (lambda: EngineConfig(pack_weights="yes"), "pack_weights must be None or a bool, got str"),
        (lambda: EngineConfig(num_blocks=np.float64(64)), "num_blocks must be an int, got float64"),
        (lambda: EngineConfig(block_size=True), "block_size must be an int, got bool"),
        (lambda: SimulatedModel(vocab_size=np.float32(64)), "vocab_size must be an int, got float32"),
    ],
)
def test_a_flag_must_be_a_bool_and_a_size_an_integer(call, message):
    with pytest.raises(TypeError, match=message):
        call()


def test_sampling_params_store_plain_python_numbers():
    params = SamplingParams(temperature=np.float32(0.5), top_p=1, top_k=np.int64(3), seed=np.uint8(7))
    assert type(params.temperature) is float and params.temperature == 0.5
    assert type(params.top_p) is float and params.top_p == 1.0
    assert type(params.top_k) is int and type(params.seed) is int
