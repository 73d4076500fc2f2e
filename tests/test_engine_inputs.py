"""The engine with a real model: bad input refused at add_request, no block lost, and how a step really runs.

Threads: torch runs on 1 thread.
"""

from __future__ import annotations

import inspect
import io
import re

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from labkit import Engine, EngineConfig, RequestOutput, SamplingParams, where_outputs_part
from labkit.runtime import runner
from labkit.runtime.attention import ATTENTION_NAME, paged_attention, slot_mapping
from labkit.runtime.hf import generate_batch
from labkit.runtime.runner import CPU_CACHE_BYTES, resolve_device, resolve_dtype
from labkit.serving.baselines import PAGE_SIZE, padded_generate, transformers_continuous

torch.set_num_threads(1)

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", max_position_embeddings=128)


BAD_REQUESTS = [
    ([], GREEDY, ValueError, "prompt is empty"),
    ([5, 1024], GREEDY, ValueError, "outside the vocabulary"),
    ([-1, 5], GREEDY, ValueError, "outside the vocabulary"),
    ([5, 2.0], GREEDY, TypeError, "must be ints"),
    ([5, True], GREEDY, TypeError, "must be ints"),
    ("hello", GREEDY, TypeError, "no tokenizer"),
    (5, GREEDY, TypeError, "prompt must be"),
    (b"hi", GREEDY, TypeError, "got bytes"),
    (bytearray(b"hi"), GREEDY, TypeError, "got bytearray"),  # raw bytes are no token ids, whatever their type
    (memoryview(b"hi"), GREEDY, TypeError, "got memoryview"),
    ([5] * 129, GREEDY, ValueError, "maximum length"),
    ([5] * 120, SamplingParams(max_new_tokens=20), ValueError, "maximum length"),
    ([5] * 100, GREEDY, ValueError, "whole KV cache"),
    ([5, 6], {"max_new_tokens": 3}, TypeError, "SamplingParams"),
]


def test_bad_requests_are_refused_and_the_others_keep_running(model, greedy_reference):
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=12))  # 96 slots
    prompts = [[7, 8, 9, 10, 11], [12, 13, 14]]
    good = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    for prompt, params, error, message in BAD_REQUESTS:
        with pytest.raises(error, match=message):
            engine.add_request(prompt, params)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(r).output_token_ids for r in good] == [greedy_reference(model, p, 6) for p in prompts]
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens"),
        ({"seed": "7"}, TypeError, "seed"),
        ({"stop_token_ids": [1.5]}, TypeError, "stop_token_ids"),
        ({"temperature": "hot"}, TypeError, "temperature"),
    ],
)
def test_invalid_sampling_values_name_the_field(fields, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_aborts_and_preemptions_give_every_block_back(model, policy):
    engine = Engine(
        model, EngineConfig(block_size=4, num_blocks=30, max_batch_tokens=64, max_num_seqs=4, policy=policy)
    )
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ids = [engine.add_request([3 + i] * (10 + 3 * i), params) for i in range(6)]
    preempted = []
    engine.step_listeners.append(lambda report: preempted.extend(report.preempted))
    for _ in range(3):
        engine.step()
    engine.abort(ids[0])  # running
    engine.abort(ids[5])  # still waiting
    with pytest.raises(KeyError):
        engine.abort(ids[0])
    while engine.has_unfinished():
        engine.step()
    assert engine.output(ids[0]).finish_reason == "abort"
    assert [engine.output(i).finish_reason for i in ids[1:5]] == ["length"] * 4
    assert engine.num_free_blocks == engine.num_blocks
    if policy == "continuous":
        assert preempted


def test_engine_config_device_and_dtype_are_checked(model):
    for device, error in (("tpu", ValueError), ("cuda:x", ValueError), (3, TypeError)):
        with pytest.raises(error, match="device"):
            Engine(model, EngineConfig(device=device, num_blocks=4))
    for dtype, error in (("int8", ValueError), (torch.int8, ValueError), (16, TypeError)):
        with pytest.raises(error, match="dtype"):
            Engine(model, EngineConfig(dtype=dtype, num_blocks=4))
    with pytest.raises(TypeError, match="model"):
        Engine(object(), EngineConfig(num_blocks=4))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            Engine(model, EngineConfig(device="cuda", num_blocks=4))
    with pytest.raises(ValueError, match=r"device must be 'auto', 'cpu' or 'cuda\[:N\]', got 'meta'"):
        Engine(model, EngineConfig(device="meta", num_blocks=4))  # a torch device, not one labkit runs on


def test_devices_and_dtypes_resolve_from_names_or_torch_objects(monkeypatch):
    assert resolve_device(torch.device("cpu")) == resolve_device("cpu") == torch.device("cpu")
    assert (resolve_dtype(None), resolve_dtype("float16"), resolve_dtype(torch.bfloat16)) == (
        None,
        torch.float16,
        torch.bfloat16,
    )
    monkeypatch.setattr(runner.torch.cuda, "is_available", lambda: True)  # a machine with a GPU
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_plain_cuda_is_placed_on_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(runner.torch.cuda, "current_device", lambda: 3)
    assert runner._placed(torch.device("cuda")) == torch.device("cuda", 3)
    assert runner._placed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert runner._placed(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize(
    "parts",
    [{"slot_mapping_fn": 5}, {"attention_fn": "sdpa"}, {"sampler": [1, 2]}],
    ids=["slot_mapping_fn", "attention_fn", "sampler"],
)
def test_a_plugged_in_part_that_is_not_callable_is_named(model, parts):
    ((name, part),) = parts.items()
    with pytest.raises(TypeError, match=f"{name} must be callable, got {type(part).__name__}"):
        Engine(model, EngineConfig(num_blocks=4), **parts)


@pytest.mark.parametrize("part", ["slot_mapping_fn", "attention_fn"])
def test_plugged_in_attention_parts_run_on_the_torch_attention(model, monkeypatch, part):
    parts = {part: {"slot_mapping_fn": slot_mapping, "attention_fn": paged_attention}[part]}
    with pytest.raises(ValueError, match="need attention_backend='torch'"):
        Engine(model, EngineConfig(num_blocks=4, attention_backend="triton"), **parts)
    asked = []  # the backend the runner asks for: "auto" may mean Triton on a GPU
    monkeypatch.setattr(runner, "resolve_attention_backend", lambda backend, device: asked.append(backend) or "torch")
    Engine(model, EngineConfig(num_blocks=4))
    Engine(model, EngineConfig(num_blocks=4), **parts)
    assert asked == ["auto", "torch"]


def test_runner_reports_what_the_engine_needs(model):
    engine = Engine(model, EngineConfig(num_blocks=4))
    runner = engine.runner
    assert runner.vocab_size == 1024 and runner.max_model_len == 128
    assert runner.eos_token_ids == frozenset({2})
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert runner.device.type == expected_device
    if expected_device == "cpu":
        assert engine.device_name.startswith("cpu (")


def test_the_eos_tokens_come_from_the_generation_config_else_from_the_model_config(model):
    saved = model.generation_config.eos_token_id, model.config.eos_token_id
    try:
        model.generation_config.eos_token_id = [3, 4]
        assert Engine(model, EngineConfig(num_blocks=4)).runner.eos_token_ids == frozenset({3, 4})
        model.generation_config.eos_token_id = None
        assert Engine(model, EngineConfig(num_blocks=4)).runner.eos_token_ids == frozenset({2})  # the model's own
        model.config.eos_token_id = None
        assert Engine(model, EngineConfig(num_blocks=4)).runner.eos_token_ids == frozenset()
    finally:
        model.generation_config.eos_token_id, model.config.eos_token_id = saved


def test_the_device_is_named_by_the_gpu_or_the_cpu_model(monkeypatch):
    monkeypatch.setattr(runner.torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    assert runner.device_name(torch.device("cuda")) == "NVIDIA H200"
    cpuinfo = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) CPU: 8 cores @ 2.10GHz\n"
    monkeypatch.setattr(runner, "open", lambda path: io.StringIO(cpuinfo), raising=False)
    assert runner.device_name(torch.device("cpu")) == "cpu (Intel(R) Xeon(R) CPU: 8 cores @ 2.10GHz)"


@pytest.mark.parametrize(
    ("cpuinfo", "processor", "machine", "expected"),
    [
        ("processor\t: 0\nCPU implementer\t: 0x41\n", "", "aarch64", "aarch64"),  # an ARM cpuinfo names no model
        (None, "Intel64 Family 6", "x86_64", "Intel64 Family 6"),  # no /proc/cpuinfo (macOS, Windows)
        (None, "", "", "unknown"),
    ],
)
def test_a_cpu_without_a_model_name_is_named_by_the_platform(monkeypatch, cpuinfo, processor, machine, expected):
    def fake_open(path):
        if cpuinfo is None:
            raise FileNotFoundError(path)
        return io.StringIO(cpuinfo)

    monkeypatch.setattr(runner, "open", fake_open, raising=False)
    monkeypatch.setattr(runner.platform, "processor", lambda: processor)
    monkeypatch.setattr(runner.platform, "machine", lambda: machine)
    assert runner.device_name(torch.device("cpu")) == f"cpu ({expected})"


def test_num_blocks_none_uses_the_documented_cpu_budget(model):
    engine = Engine(model, EngineConfig(block_size=16, device="cpu"))
    # 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes
    assert engine.num_blocks == CPU_CACHE_BYTES // (2 * 2 * 16 * 2 * 16 * 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, "float16"])
def test_half_precision_runs(tiny_model, dtype):
    model = tiny_model("qwen3")
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu", dtype=dtype))
    out = engine.generate([[5, 6, 7, 8, 9]], GREEDY)[0]
    assert next(model.parameters()).dtype == (torch.float16 if dtype == "float16" else dtype)
    assert engine.runner.cache.data.dtype == next(model.parameters()).dtype
    assert len(out.output_token_ids) == 6
    assert engine.num_free_blocks == engine.num_blocks


def test_each_step_is_one_packed_forward_with_logits_only_for_sampled_rows(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=16, max_num_seqs=4))
    calls = []
    hooks = [
        model.register_forward_hook(lambda _, args, kwargs, __: calls.append(("model", kwargs)), with_kwargs=True),
        model.lm_head.register_forward_hook(lambda _, args, __: calls.append(("lm_head", args[0].shape))),
    ]
    try:
        for prompt in ([4] * 10, [5] * 3, [6] * 7):
            engine.add_request(prompt, GREEDY)
        while engine.has_unfinished():
            calls.clear()
            report = engine.step()
            forward = [c for kind, c in calls if kind == "model"]
            assert len(forward) == 1  # the whole step is one forward pass
            input_ids, positions = forward[0]["input_ids"], forward[0]["position_ids"]
            assert input_ids.shape == (1, sum(w.num_tokens for w in report.scheduled))  # packed, no padding
            expected = [w.start + i for w in report.scheduled for i in range(w.num_tokens)]
            assert positions[0].tolist() == expected
            lm_head_rows = [shape[1] for kind, shape in calls if kind == "lm_head"]
            assert lm_head_rows == [report.num_generated_tokens]
    finally:
        for hook in hooks:
            hook.remove()


def test_static_policy_computes_its_padding_rows(model, greedy_reference):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, policy="static", max_num_seqs=2))
    seen = []

    def record(module, args, kwargs, output):
        seen.append(kwargs["input_ids"].shape[1])

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        prompts = [[4] * 9, [5] * 3]
        params = [SamplingParams(max_new_tokens=2, ignore_eos=True), SamplingParams(max_new_tokens=5, ignore_eos=True)]
        outputs = engine.generate(prompts, params)
    finally:
        hook.remove()
    # Prefill: 9 + 3 tokens and 6 padding rows; then 2 rows per step, the finished member's included.
    assert seen == [18, 2, 2, 2, 2]
    assert [o.output_token_ids for o in outputs] == [
        greedy_reference(model, p, n) for p, n in zip(prompts, (2, 5), strict=True)
    ]


def test_attention_reads_keys_and_values_from_the_blocks(model, greedy_reference):
    prompts = [[9, 8, 7, 6, 5, 4, 3], [10, 11, 12, 13]]
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=16))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in prompts]
    engine.step()  # both prompts are now in the cache
    blocks = engine.allocator.block_tables[ids[0]]
    engine.runner.cache.data[:, :, :, blocks] = 0.0  # wipe request 0's keys and values
    while engine.has_unfinished():
        engine.step()
    assert engine.output(ids[0]).output_token_ids[1:] != greedy_reference(model, prompts[0], 8)[1:]
    assert engine.output(ids[1]).output_token_ids == greedy_reference(model, prompts[1], 8)


def test_the_model_is_left_as_it_was(model, greedy_reference):
    threads = torch.get_num_threads()
    Engine(model, EngineConfig(num_blocks=8)).generate([[5, 6, 7]], GREEDY)
    assert model.config._attn_implementation == "sdpa" != ATTENTION_NAME
    assert torch.get_num_threads() == threads
    assert len(greedy_reference(model, [5, 6, 7], 3)) == 3  # plain generate still works


def test_generate_batch_mirrors_transformers(model, greedy_reference):
    inputs = [[5, 6, 7, 8], [9, 10, 11] * 5, [42]]
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, num_blocks=32, block_size=8)
    results = generate_batch(model, inputs=inputs, generation_config=config)
    assert list(results) == ["req_0", "req_1", "req_2"]
    for i, prompt in enumerate(inputs):
        result = results[f"req_{i}"]
        assert result.request_id == f"req_{i}" and result.prompt_ids == prompt and result.is_finished()
        assert result.generated_tokens == greedy_reference(model, prompt, 5)
    assert generate_batch(model, [], config) == {}


def test_generate_batch_takes_every_argument_of_transformers_own(model):
    """A call written for model.generate_batch runs unchanged: every parameter it has, labkit's has too."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    theirs = inspect.signature(ContinuousMixin.generate_batch).parameters
    ours = inspect.signature(generate_batch).parameters
    missing = [name for name, p in theirs.items() if name != "self" and p.kind != p.VAR_KEYWORD and name not in ours]
    assert not missing, f"transformers' generate_batch has {missing}, labkit's has not"

    def positional(parameters):
        return [name for name, p in parameters.items() if p.kind == p.POSITIONAL_OR_KEYWORD]

    assert positional(ours)[1:] == positional(theirs)[1:]  # after model / self: a positional call means the same
    inputs = [[5, 6, 7, 8], [9, 10, 11] * 5]
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, num_blocks=32, block_size=8)
    plain = generate_batch(model, inputs, config)
    timed = generate_batch(model, inputs, config, record_timestamps=True, persistent_manager=True, warmup=False)
    for name, result in timed.items():
        assert result.generated_tokens == plain[name].generated_tokens and plain[name].timestamps is None
        assert len(result.timestamps) == len(result.generated_tokens) and result.timestamps == sorted(result.timestamps)


def test_generate_batch_honours_the_batching_knobs(model):
    tiny_cache = GenerationConfig(max_new_tokens=4, num_blocks=1, block_size=4)
    with pytest.raises(ValueError, match=r"whole KV cache holds 4 \(1 blocks x 4\)"):
        generate_batch(model, [[5] * 10], tiny_cache)
    batching = ContinuousBatchingConfig(num_blocks=2, max_batch_tokens=8, **{PAGE_SIZE: 4})
    with pytest.raises(ValueError, match="whole KV cache holds 8"):
        generate_batch(model, [[5] * 10], GenerationConfig(max_new_tokens=4), continuous_batching_config=batching)
    small_budget = GenerationConfig(max_new_tokens=4, max_batch_tokens=8)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        generate_batch(model, [[5] * 10], small_budget, policy="static", chunked_prefill=False)
    with pytest.raises(TypeError, match="unknown engine options"):
        generate_batch(model, [[5]], GenerationConfig(max_new_tokens=4), colour="blue")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_batch(model, [[5]], GenerationConfig())


def test_generate_batch_sampling_and_eos_come_from_the_generation_config(model, greedy_reference):
    prompt = [5, 6, 7, 8]
    greedy = greedy_reference(model, prompt, 6)
    stop_at = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=greedy[2])
    assert generate_batch(model, [prompt], stop_at)["req_0"].generated_tokens == greedy[:3]
    sampled = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.5, top_k=0, top_p=1.0, eos_token_id=-1)
    runs = [generate_batch(model, [prompt] * 4, sampled) for _ in range(2)]
    tokens = [r.generated_tokens for run in runs for r in run.values()]
    assert len({tuple(t) for t in tokens}) > 1  # do_sample draws, greedy would repeat itself


def test_generate_batch_sampling_is_reproducible_as_in_transformers(model):
    inputs = [[5, 6, 7, 8]] * 3
    sampled = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.5, top_k=0, top_p=1.0, eos_token_id=-1)

    def tokens(**kwargs):
        return [r.generated_tokens for r in generate_batch(model, inputs, sampled, **kwargs).values()]

    torch.manual_seed(0)
    first = tokens()
    torch.manual_seed(0)
    assert tokens() == first and len({tuple(t) for t in first}) > 1  # the same run again; each request its own draws
    seeded = ContinuousBatchingConfig(seed=3)
    assert tokens(continuous_batching_config=seeded) == tokens(continuous_batching_config=seeded)
    other_seed = ContinuousBatchingConfig(seed=4)
    assert tokens(continuous_batching_config=seeded) != tokens(continuous_batching_config=other_seed)  # the seed counts
    alone = generate_batch(model, inputs[:1], sampled, continuous_batching_config=seeded)["req_0"].generated_tokens
    assert alone == tokens(continuous_batching_config=seeded)[0]  # request 0 draws the same alone or in the batch


def test_generate_batch_seeds_near_2_64_wrap_and_a_bad_seed_is_named_as_passed(model):
    """Request i draws with seed + i, wrapped into the 64 bits a seed has; a seed out of range is refused as given."""
    sampled = GenerationConfig(max_new_tokens=4, do_sample=True, temperature=1.5, top_k=0, top_p=1.0, eos_token_id=-1)

    def tokens(inputs, seed):
        results = generate_batch(model, inputs, sampled, ContinuousBatchingConfig(seed=seed))
        return [r.generated_tokens for r in results.values()]

    top = tokens([[5, 6, 7], [8, 9]], 2**64 - 1)
    assert top[1] == tokens([[8, 9]], 0)[0]  # request 1 draws with seed 2**64, that is 0
    for seed, error, message in [
        (-5, ValueError, "continuous_batching_config.seed must be in [0, 2**64) (or None), got -5"),
        (2**64, ValueError, f"continuous_batching_config.seed must be in [0, 2**64) (or None), got {2**64}"),
        (1.5, TypeError, "continuous_batching_config.seed must be an int, got float"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            tokens([[5, 6, 7]], seed)


def test_baselines_generate_what_the_engine_generates(model, greedy_reference):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12] * 9]
    wanted = [3, 6, 4]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    labkit = [o.output_token_ids for o in Engine(model, EngineConfig(num_blocks=16)).generate(prompts, params)]
    assert labkit == [greedy_reference(model, p, n) for p, n in zip(prompts, wanted, strict=True)]
    assert padded_generate(model, prompts, wanted, batch_size=2) == labkit
    assert transformers_continuous(model, prompts, wanted, block_size=8, num_blocks=16) == labkit
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="max_new_tokens"):
        padded_generate(model, prompts, wanted[:2])


@pytest.mark.parametrize("pad_token_id", [-1, 1024, 5000, None])
def test_a_pad_token_id_outside_the_vocabulary_or_unset_pads_with_a_valid_one(model, greedy_reference, pad_token_id):
    """Some configs carry pad_token_id = -1, or none; a static batch's padding rows must still embed."""
    original, model.config.pad_token_id = model.config.pad_token_id, pad_token_id
    try:
        engine = Engine(model, EngineConfig(block_size=4, num_blocks=32, policy="static"))
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 6)]
        outputs = engine.generate([[5, 6, 7], [8, 9]], params)
    finally:
        model.config.pad_token_id = original
    assert engine.runner.pad_token_id == 0
    assert [o.output_token_ids for o in outputs] == [
        greedy_reference(model, [5, 6, 7], 2),
        greedy_reference(model, [8, 9], 6),
    ]


@pytest.mark.parametrize("pad_token_id", [0, 1023])
def test_a_pad_token_id_inside_the_vocabulary_is_the_padding(model, pad_token_id):
    original, model.config.pad_token_id = model.config.pad_token_id, pad_token_id
    try:
        assert Engine(model, EngineConfig(num_blocks=4)).runner.pad_token_id == pad_token_id
    finally:
        model.config.pad_token_id = original


def test_static_dead_rows_on_a_block_boundary(model, greedy_reference):
    """A finished member's padding row at a position past its own blocks must not break the step or its neighbours."""
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, policy="static", max_num_seqs=2))
    params = [SamplingParams(max_new_tokens=5, ignore_eos=True), SamplingParams(max_new_tokens=9, ignore_eos=True)]
    outputs = engine.generate([[5] * 4, [6] * 4], params)  # request 0's dead rows reach position 8, past its 2 blocks
    expected = [greedy_reference(model, [5] * 4, 5), greedy_reference(model, [6] * 4, 9)]
    assert [o.output_token_ids for o in outputs] == expected
    assert engine.num_free_blocks == engine.num_blocks


def test_where_outputs_part_names_the_first_token_that_differs_in_each_request() -> None:
    """The message of a failing token-for-token check in the notebooks: which requests, at which output token,
    and each run's token there; "" for equal runs, so that ``assert not parted, parted`` passes."""

    def outputs(*runs: list[int]) -> list[RequestOutput]:
        return [RequestOutput(i, [1, 2], tokens, None, "length", None) for i, tokens in enumerate(runs)]

    expected = outputs([5, 6, 7], [8, 9], [3, 3, 3])
    assert where_outputs_part(expected, outputs([5, 6, 7], [8, 9], [3, 3, 3])) == ""
    said = where_outputs_part(expected, outputs([5, 6, 7], [8, 4], [3, 3]), ("labkit's engine", "yours"))
    assert said == (
        "request 1 parts at output token 1: labkit's engine 9, yours 4;"
        " request 2 parts at output token 2: labkit's engine 3, yours no token (it ended)"
    )
    many = where_outputs_part(outputs(*[[1]] * 5), outputs(*[[2]] * 5))
    assert many.count("parts at") == 3 and many.endswith("; 2 more requests differ")
    assert where_outputs_part(expected, expected[:2]) == "expected has 3 outputs, got 2"
