"""What a new user trips over: each mistake gets one clear error that names what is wrong, or just works.

Threads: torch runs on 1 thread.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from transformers import GenerationConfig, GPT2Config, LlamaConfig, LlamaModel

import labkit
from labkit import Engine, EngineConfig, SamplingParams, SimulatedModel, generate_batch, load_trace
from labkit.cli import main
from labkit.core.blocks import BlockAllocator
from labkit.runtime.hf import _sampling_params
from labkit.runtime.runner import (
    CPU_CACHE_BYTES,
    blocks_beside_gather,
    cpu_cache_blocks,
    kv_bytes_per_block,
    kv_layout,
)
from labkit.viz import BlockMap, LiveThroughput, Recorder, Timeline, record

torch.set_num_threads(1)

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama", max_position_embeddings=128)


def sim_engine() -> Engine:
    return Engine(SimulatedModel(), EngineConfig(block_size=4, num_blocks=32, max_batch_tokens=32, max_num_seqs=4))


# ---------------------------------------------------------------------------------------------- import labkit
def test_import_labkit_is_torch_free_and_reaches_every_subpackage():
    code = """
import sys
import labkit
assert "torch" not in sys.modules, "import labkit imported torch"
assert callable(labkit.viz.BlockMap)
assert labkit.serving.metrics.__name__ == "labkit.serving.metrics"
assert callable(labkit.models.load) and callable(labkit.models.random_model)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        labkit.serving.nothing_here  # noqa: B018


# ---------------------------------------------------------------------------------------------- a shared model
def test_a_second_engine_may_not_convert_a_model_another_engine_runs(tiny_model, greedy_reference):
    model = tiny_model("llama", max_position_embeddings=128)
    first = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu"))
    record(first)  # a recorder holds its engine weakly: it keeps no engine alive
    with pytest.raises(ValueError, match=r"another Engine as float32 on cpu; an Engine with bfloat16 on cpu"):
        Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu", dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.float32  # refused before anything changed
    # The same dtype, named or kept (None), converts nothing and may share the model.
    second = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu", dtype="float32"))
    third = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu"))
    for engine in (first, second, third):
        assert engine.generate([[5, 6, 7]], GREEDY)[0].output_token_ids == greedy_reference(model, [5, 6, 7], 6)
    del first, second, third, engine
    # Once no engine runs it, the model may be converted.
    half = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu", dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.bfloat16 == half.runner.cache.data.dtype
    assert len(half.generate([[5, 6, 7]], GREEDY)[0].output_token_ids) == 6


def test_an_engine_dropped_in_a_reference_cycle_frees_its_model_before_the_collector_runs(tiny_model):
    model = tiny_model("llama", max_position_embeddings=128)
    first = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu"))
    first.step_listeners.append(lambda report, engine=first: engine.num_free_blocks)  # it holds its engine: a cycle
    gc.disable()  # the cycle stays until something collects it
    try:
        del first
        half = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu", dtype="bfloat16"))
    finally:
        gc.enable()
    assert next(model.parameters()).dtype == torch.bfloat16 == half.runner.cache.data.dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_second_engine_may_not_move_a_model_another_engine_runs(tiny_model, greedy_reference):
    model = tiny_model("llama", max_position_embeddings=128)
    first = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu"))
    with pytest.raises(ValueError, match="another Engine as float32 on cpu"):
        Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cuda"))
    assert next(model.parameters()).device.type == "cpu"
    assert first.generate([[5, 6, 7]], GREEDY)[0].output_token_ids == greedy_reference(model, [5, 6, 7], 6)


# ---------------------------------------------------------------------------------------------- what is a model
def test_a_base_model_without_an_lm_head_is_refused_at_construction(model):
    base = LlamaModel(model.config)
    with pytest.raises(TypeError, match=r"LlamaModel has no LM head.*AutoModelForCausalLM"):
        Engine(base, EngineConfig(num_blocks=4, device="cpu"))


def test_a_torch_module_with_a_config_but_no_lm_head_method_is_refused_as_a_base_model(model):
    module = torch.nn.Linear(4, 4)
    module.config = model.config
    with pytest.raises(TypeError, match=r"Linear has no LM head.*AutoModelForCausalLM"):
        Engine(module, EngineConfig(num_blocks=4, device="cpu"))


def _tiny(config_class: type, model_class: type, **overrides: object) -> torch.nn.Module:
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return model_class(
        config_class(**shape, num_key_value_heads=1, head_dim=16, max_position_embeddings=128, **overrides)
    )


def test_a_model_whose_attention_needs_a_term_labkit_does_not_compute_is_refused_at_construction():
    """Gemma 2's logit soft-capping and gpt-oss's sinks reach an attention function as keyword arguments that
    labkit's would ignore: the engine refuses the model instead of generating wrong tokens."""
    gemma = _tiny(transformers.Gemma2Config, transformers.Gemma2ForCausalLM)
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM cannot run .*leaves out its logit soft-capping.*generate"):
        Engine(gemma, EngineConfig(num_blocks=4, device="cpu"))
    sinks = _tiny(transformers.GptOssConfig, transformers.GptOssForCausalLM, num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(ValueError, match=r"GptOssForCausalLM cannot run .*leaves out its attention sinks"):
        Engine(sinks, EngineConfig(num_blocks=4, device="cpu"))


def _phi3_longrope() -> torch.nn.Module:
    half = 8  # head_dim 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half, "long_factor": [4.0] * half}
    config = transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, original_max_position_embeddings=32, pad_token_id=0,
        rope_parameters={**rope, "original_max_position_embeddings": 32},
    )  # fmt: skip
    return transformers.Phi3ForCausalLM(config)


OTHER_FORWARDS = {  # models whose forward labkit's paged steps would compute otherwise: wrong tokens, no error
    r"XGLMForCausalLM cannot run .*: it does not declare transformers' attention": lambda: transformers.XGLMForCausalLM(
        transformers.XGLMConfig(vocab_size=64, d_model=32, ffn_dim=64, num_layers=2, attention_heads=2)
    ),
    r"GPTNeoForCausalLM cannot run .*: it does not declare transformers' attention": lambda: (
        transformers.GPTNeoForCausalLM(
            transformers.GPTNeoConfig(
                vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]]
            )
        )
    ),
    r"Lfm2ForCausalLM cannot run .*: its layers keep a state other than keys and values \(conv\)": lambda: _tiny(
        transformers.Lfm2Config, transformers.Lfm2ForCausalLM, layer_types=["conv", "full_attention"]
    ),
}


@pytest.mark.parametrize(("message", "make"), OTHER_FORWARDS.items(), ids=["xglm", "gpt-neo", "lfm2"])
def test_a_model_whose_forward_labkit_would_compute_otherwise_is_refused_and_left_as_it_was(message, make):
    """Models with their own attention code never called labkit's (each step saw only its new tokens), and hybrids
    lost their convolution or SSM state between steps: each gave wrong tokens without an error. The refusal comes
    before the model is converted."""
    model = make()
    with pytest.raises(ValueError, match=message):
        Engine(model, EngineConfig(num_blocks=8, device="cpu", dtype="bfloat16"))
    assert next(model.parameters()).dtype == torch.float32 and model.training


def test_a_longrope_model_is_served_up_to_the_length_it_was_trained_at(greedy_reference):
    """longrope picks its frequencies from the largest position in a forward pass, and a packed step holds many
    requests: a short request batched with one past original_max_position_embeddings (32 here) got the long
    frequencies. Up to that length every step uses the short ones, so the engine serves that far, token for token."""
    torch.manual_seed(0)
    model = _phi3_longrope().eval()
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, max_batch_tokens=8, device="cpu"))
    assert engine.runner.max_model_len == 32
    prompts = [[5, 9, 3], list(range(3, 27))]  # a short prompt batched with one chunked over three steps
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [o.output_token_ids for o in outputs] == [greedy_reference(model, p, 5) for p in prompts]
    with pytest.raises(ValueError, match="32"):
        engine.add_request(list(range(3, 30)), SamplingParams(max_new_tokens=8))


def test_a_model_put_back_in_training_mode_fails_its_step_instead_of_sampling_with_dropout():
    model = _tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM, attention_dropout=0.5)
    engine = Engine(model, EngineConfig(num_blocks=8, block_size=4, device="cpu"))
    assert not model.training  # the engine runs it in eval mode
    model.train()
    with pytest.raises(ValueError, match=r"training mode \(model.train\(\)\).*call model.eval\(\) first"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    model.eval()
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))[0].output_token_ids) == 2


def test_a_model_never_loaded_is_refused_by_name():
    with torch.device("meta"):
        model = _tiny(transformers.LlamaConfig, transformers.LlamaForCausalLM)
    with pytest.raises(ValueError, match="LlamaForCausalLM's weights are on the 'meta' device: it was never loaded"):
        Engine(model, EngineConfig(num_blocks=8, device="cpu"))


def test_gemma_2_without_soft_capping_matches_generate(greedy_reference):
    """The same family without the missing term is served, sliding window and all, token for token."""
    torch.manual_seed(0)
    model = _tiny(
        transformers.Gemma2Config, transformers.Gemma2ForCausalLM, attn_logit_softcapping=None, sliding_window=8
    )
    prompt = [1, 5, 9, 3, 7, 2, 11, 4, 6, 8, 10, 12]
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, device="cpu"))
    [out] = engine.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert out.output_token_ids == greedy_reference(model.eval(), prompt, 20)


@pytest.mark.parametrize(
    "not_a_model",
    [
        object(),
        torch.nn.Linear(4, 4),
        SimpleNamespace(config=None, get_output_embeddings=lambda: torch.nn.Linear(4, 4)),
    ],
    ids=["object", "plain torch module", "a model's attributes on no torch module"],
)
def test_what_is_not_a_transformers_model_is_refused_as_such(not_a_model):
    """A torch module without a transformers config is named for what it is, not for the LM head it also lacks."""
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel"):
        Engine(not_a_model, EngineConfig(num_blocks=4, device="cpu"))


def test_load_of_a_folder_without_a_checkpoint_says_what_is_missing(tmp_path, model):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=rf"{empty}.*holds no checkpoint.*no config.json and no weights"):
        labkit.models.load(empty, device="cpu")
    weights_only = tmp_path / "weights-only"
    model.save_pretrained(weights_only)  # no tokenizer saved next to it
    with pytest.raises(ValueError, match=rf"{weights_only}.*holds no checkpoint: it has no tokenizer") as error:
        labkit.models.load(weights_only, device="cpu")
    assert "no config.json" not in str(error.value) and "no weights" not in str(error.value)


# ---------------------------------------------------------------------------------------------- generate_batch
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("num_beams", 2),
        ("repetition_penalty", 1.2),
        ("min_new_tokens", 3),
        ("no_repeat_ngram_size", 2),
        ("length_penalty", 0.5),
        ("num_return_sequences", 2),
        ("min_p", 0.1),
        ("suppress_tokens", [5]),
    ],
)
def test_generate_batch_refuses_each_setting_it_does_not_implement(model, name, value):
    config = GenerationConfig(max_new_tokens=3, do_sample=True, **{name: value})
    with pytest.raises(ValueError, match=re.escape(f"sets {name}={value!r} (off: ")):
        generate_batch(model, [[5, 6]], config)


def test_generate_batch_accepts_those_settings_switched_off(model, greedy_reference):
    off = GenerationConfig(
        max_new_tokens=4, num_beams=1, repetition_penalty=1.0, min_new_tokens=0, length_penalty=1.0,
        no_repeat_ngram_size=0, num_return_sequences=1, min_p=0.0, penalty_alpha=0.0, eos_token_id=-1, num_blocks=16,
        block_size=8,
    )  # fmt: skip
    result = generate_batch(model, [[5, 6, 7]], off)["req_0"]
    assert result.generated_tokens == greedy_reference(model, [5, 6, 7], 4)


def test_generate_batch_follows_transformers_on_do_sample(model, greedy_reference):
    # do_sample unset or False is greedy whatever the temperature, as in model.generate.
    hot_but_greedy = GenerationConfig(max_new_tokens=4, temperature=5.0, eos_token_id=-1, num_blocks=16)
    assert generate_batch(model, [[5, 6, 7]], hot_but_greedy)["req_0"].generated_tokens == greedy_reference(
        model, [5, 6, 7], 4
    )
    # do_sample with nothing else set samples as transformers does: temperature 1, top-k 50, top-p 1.
    params = _sampling_params(GenerationConfig(do_sample=True), max_new_tokens=4)
    assert (params.temperature, params.top_k, params.top_p) == (1.0, 50, 1.0)


def test_generate_batch_wants_a_generation_config_not_a_dict(model):
    with pytest.raises(TypeError, match="GenerationConfig, got dict"):
        generate_batch(model, [[5, 6]], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match="continuous_batching_config"):
        generate_batch(model, [[5, 6]], GenerationConfig(max_new_tokens=3), continuous_batching_config={})


# ---------------------------------------------------------------------------------------------- trace files
def good_trace(tmp_path, name: str = "good.json"):
    engine = sim_engine()
    recorder = record(engine)
    engine.generate([[5, 6, 7, 8, 9], [10, 11]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    return recorder.save(tmp_path / name)


def broken_traces(tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (file content, the problem the error must name)."""
    payload = json.loads(good_trace(tmp_path).read_text())
    text = json.dumps(payload)
    out_of_range = json.loads(text)
    index, step = next((i, s) for i, s in enumerate(out_of_range["steps"]) if s["block_events"])
    step["block_events"][0][1] = step["num_blocks"]
    no_scheduled = json.loads(text)
    del no_scheduled["steps"][1]["scheduled"]
    bad_request = json.loads(text)
    bad_request["meta"]["requests"]["0"] = {"prompt_tokens": 5}
    return {
        "empty": ("", "the file is empty"),
        "truncated": (text[: len(text) // 2], r"not valid JSON \(truncated\?\)"),
        "not json": ("step 1: request 0 admitted\n", "not valid JSON"),
        "top-level list": ("[1, 2]", "expected a JSON object .* got an array"),
        "no steps": (json.dumps({"version": 1, "meta": {}}), "'steps' must be a list"),
        "missing field": (json.dumps(no_scheduled), "step 1: missing field 'scheduled'"),
        "block id": (
            json.dumps(out_of_range),
            rf"step {index}: block id {step['num_blocks']} is outside the cache's blocks",
        ),
        "bad row": (
            text.replace('"scheduled": [[', '"scheduled": [[[0], ', 1),
            "step 0: each item of 'scheduled' must be \\[request_id, start",
        ),
        "bad request info": (json.dumps(bad_request), "meta 'requests' '0' must hold the numbers"),
    }


def test_each_broken_trace_gets_one_error_naming_the_file_and_the_problem(tmp_path):
    for name, (content, problem) in broken_traces(tmp_path).items():
        path = tmp_path / f"{name.replace(' ', '-')}.json"
        path.write_text(content)
        for read in (Recorder.load, BlockMap):
            with pytest.raises(ValueError, match=rf"cannot read trace '{path}': {problem}") as error:
                read(path)
            one_error = error.value.__cause__ is None and (
                error.value.__context__ is None or error.value.__suppress_context__
            )
            assert one_error, name  # no chained traceback
    good = good_trace(tmp_path)
    assert load_trace(good)[0] == Recorder.load(good).reports


@pytest.mark.parametrize("widget", [Timeline, LiveThroughput])
def test_widgets_given_several_runs_say_which_run_is_broken(tmp_path, widget):
    good = good_trace(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text("")
    with pytest.raises(ValueError, match=rf"{widget.__name__} run 'static': cannot read trace '{broken}'"):
        widget({"continuous": good, "static": broken})
    with pytest.raises(TypeError, match=rf"{widget.__name__} run 'static': expected an Engine"):
        widget({"continuous": good, "static": 42})


# ---------------------------------------------------------------------------------------------- request values
@pytest.mark.parametrize(
    ("arrival_time", "error", "message"),
    [
        ("soon", TypeError, "arrival_time must be a number"),
        (None, None, None),
        (float("nan"), ValueError, "arrival_time must be a finite number, got nan"),
        (float("inf"), ValueError, "arrival_time must be a finite number, got inf"),
        (True, TypeError, "arrival_time must be a number"),
        (1.8e9, ValueError, r"arrival_time \(1800000000.0\) is later than the engine's clock \(0.25\)"),  # time.time()
    ],
)
def test_arrival_time_must_be_a_finite_number_no_later_than_now(arrival_time, error, message):
    engine = sim_engine()
    engine.runner.wait_until(0.25)  # the simulated clock, as after some steps
    if error is None:
        engine.add_request([5, 6], arrival_time=np.float32(0.25))
        assert type(engine.requests[0].metrics.arrival_time) is float
        return
    with pytest.raises(error, match=message):
        engine.add_request([5, 6], arrival_time=arrival_time)
    assert not engine.requests and not engine.has_unfinished()


def test_stop_token_ids_must_be_in_the_vocabulary(model):
    engine = Engine(model, EngineConfig(num_blocks=8, device="cpu"))
    for token in (1024, -1):
        with pytest.raises(ValueError, match=rf"stop token id {token} is outside the vocabulary \[0, 1024\)"):
            engine.add_request([5, 6], SamplingParams(stop_token_ids=[3, token]))
    assert not engine.requests
    engine.add_request([5, 6], SamplingParams(stop_token_ids=[0, 1023]))


@pytest.mark.parametrize("temperature", [1e-30, 1e-45, 1e-300])
def test_a_tiny_temperature_samples_the_greedy_tokens(model, temperature, greedy_reference):
    # Dividing raw logits by 1e-30 overflows to inf and the softmax to NaN; the limit is greedy.
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu"))
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    params = [SamplingParams(max_new_tokens=6, temperature=temperature, seed=s, ignore_eos=True) for s in (0, 1)]
    outputs = engine.generate(prompts, params)
    assert [o.output_token_ids for o in outputs] == [greedy_reference(model, p, 6) for p in prompts]


def test_seeds_outside_the_samplers_64_bits_are_refused():
    """The sampler draws from a seed's 64 bits: seeds 2**64 apart would give the same tokens."""
    for seed in (-1, 2**64, 2**70):
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_a_refused_engine_leaves_the_model_as_it_was(model):
    """An allocator that cannot be built (a learner's, without the prefix-caching keyword) refuses the engine after
    the runner converted the model: the model goes back to its dtype, and a later engine may convert it again."""

    class OldAllocator(BlockAllocator):
        def __init__(self, num_blocks: int, block_size: int) -> None:
            super().__init__(num_blocks, block_size)

    config = EngineConfig(num_blocks=8, device="cpu", dtype="bfloat16", enable_prefix_caching=True)
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        Engine(model, config, allocator_cls=OldAllocator)
    assert next(model.parameters()).dtype == torch.float32
    Engine(model, EngineConfig(num_blocks=8, device="cpu", dtype="float16"))  # no engine holds the model
    model.to(torch.float32)


@pytest.mark.parametrize(("pack_weights", "step"), [(True, "pack"), (None, "faster_than_linear")])
def test_an_engine_whose_weight_packing_fails_leaves_the_model_as_it_was(model, monkeypatch, pack_weights, step):
    """Packing copies the weights (out of memory) and, by default, times them (a Ctrl-C), after the runner converted
    the model: either failure refuses the engine with the model back in its dtype."""
    from labkit.runtime import packed

    owner = packed.PackedLayer if step == "pack" else packed.PackedLinears

    def fails(self):
        raise MemoryError("no room for a second copy of the weights")

    monkeypatch.setattr(owner, step, fails)
    monkeypatch.setattr(packed, "_FASTER", type(packed._FASTER)())  # as if no engine had timed this model yet
    config = EngineConfig(num_blocks=8, device="cpu", dtype="bfloat16", pack_weights=pack_weights)
    with pytest.raises(MemoryError):
        Engine(model, config)
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize("part", ["allocator_cls", "scheduler_cls"])
def test_a_factory_that_makes_no_allocator_or_scheduler_is_refused_at_construction(part):
    with pytest.raises(TypeError, match=rf"{part} made a NoneType, not a"):
        Engine(SimulatedModel(), EngineConfig(num_blocks=8, block_size=4), **{part: lambda *args, **kwargs: None})


@pytest.mark.parametrize("real", [float, np.float16, np.float32, np.float64, np.longdouble])
def test_every_kind_of_real_number_is_accepted_alike(model, real):
    params = SamplingParams(
        max_new_tokens=np.int64(5), temperature=real(0.75), top_p=real(0.5), top_k=np.int32(7), seed=np.uint8(3)
    )
    assert (type(params.temperature), type(params.top_p)) == (float, float)
    assert (type(params.max_new_tokens), type(params.top_k), type(params.seed)) == (int, int, int)
    assert params == SamplingParams(max_new_tokens=5, temperature=float(real(0.75)), top_p=0.5, top_k=7, seed=3)
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=16, device="cpu"))
    plain = SamplingParams(max_new_tokens=5, temperature=float(real(0.75)), top_p=0.5, top_k=7, seed=3)
    sampled, expected = engine.generate([[5, 6, 7], [5, 6, 7]], [params, plain])
    assert sampled.output_token_ids == expected.output_token_ids


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"temperature": True}, TypeError, "temperature must be a real number, got bool"),
        ({"temperature": np.bool_(True)}, TypeError, "temperature must be a real number"),
        ({"top_p": np.float32("nan")}, ValueError, "top_p must be a number, got NaN"),
        ({"temperature": np.float64("nan")}, ValueError, "temperature must be a number, got NaN"),
        ({"temperature": float("inf")}, ValueError, "temperature must be a finite number"),
        ({"seed": np.float64(3.0)}, TypeError, "seed must be an int"),
    ],
)
def test_bools_nan_and_infinity_are_refused(fields, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**fields)


# ---------------------------------------------------------------------------------------------- the command line
def test_demo_refuses_a_negative_step_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--model", "sim", "--steps", "-1"])
    assert exit_info.value.code == 2
    assert "error: --steps must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize("count", ["0", "-1"])
def test_demo_and_bench_give_one_message_for_a_bad_request_count(capsys, count):
    messages = []
    for command in ("demo", "bench"):
        try:
            code = main([command, "--model", "sim", "--num-requests", count])
        except SystemExit as exit_info:
            code = exit_info.code
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        messages.append(err.split("error: ", 1)[1])
    assert messages == [f"--num-requests must be >= 1, got {count}"] * 2


# ---------------------------------------------------------------------------------------------- the GPU budget
@pytest.mark.parametrize(
    ("budget_blocks", "max_num_seqs", "layers", "per_request"),
    [(1000, 4, 32, 100), (3225, 64, 32, 8192), (100, 64, 2, 8192), (10, 1, 1, 4), (6, 1, 1, 4), (1, 64, 32, 8192)],
)
def test_a_gpu_cache_beside_the_torch_attentions_copy_takes_what_the_copy_leaves(
    budget_blocks, max_num_seqs, layers, per_request
):
    """Llama-3.1-8B's 128k context (8192 blocks of 16) once left one block of cache in 7.5 GiB: the copy of every
    request's whole possible context was set aside although no context can outgrow the cache itself."""
    per_block = 1000
    blocks = blocks_beside_gather(budget_blocks * per_block, per_block, max_num_seqs, layers, per_request)

    def memory(n):  # the cache and the largest copy it can need: every request's context padded to the longest
        return n * per_block + max_num_seqs * min(per_request, n) * per_block / layers

    assert blocks >= 1 and (memory(blocks) <= budget_blocks * per_block or blocks == 1)
    assert memory(blocks + 1) > budget_blocks * per_block  # the largest cache that fits


# ---------------------------------------------------------------------------------------------- the CPU budget
def test_the_kv_layout_is_read_from_the_config_or_derived_where_it_is_not_named():
    named = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3)
    assert kv_layout(SimpleNamespace(config=named)) == (3, 2, 32)  # head_dim need not be hidden_size / heads
    # GPT-2's config names neither: one KV head per query head, each hidden_size / heads wide.
    derived = GPT2Config(n_embd=96, n_head=4, n_layer=5)
    assert kv_layout(SimpleNamespace(config=derived)) == (5, 4, 24)


def test_num_blocks_none_never_exceeds_the_cpu_budget(model):
    per_token = kv_bytes_per_block(model, 1)
    largest = CPU_CACHE_BYTES // per_token  # the biggest block that still fits, once
    for block_size in (1, 16, 1000, largest // 3 + 1, largest):
        blocks = cpu_cache_blocks(model, block_size)
        assert blocks >= 1 and blocks * kv_bytes_per_block(model, block_size) <= CPU_CACHE_BYTES
    with pytest.raises(ValueError, match=r"one KV-cache block of \d+ tokens takes 256 MiB, more than the 256 MiB"):
        cpu_cache_blocks(model, largest + 1)
    gc.collect()
    with pytest.raises(ValueError, match="use a smaller block_size, or set num_blocks"):
        Engine(model, EngineConfig(block_size=largest + 1, device="cpu"))
