"""The simulated model: deterministic tokens, a modelled clock, and an engine core that never imports torch."""

import itertools
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from labkit import CostModel, Engine, EngineConfig, SamplingParams, SimulatedModel
from labkit.core.sim import COST_PRESETS

REPO_ROOT = Path(__file__).resolve().parents[1]
EOS = SimulatedModel.eos_token_id


def make_prompts(n: int, min_len: int = 1, max_len: int = 12) -> list[list[int]]:
    """Distinct prompts of assorted lengths (a fixed recipe, so every run sees the same workload)."""
    span = max_len - min_len + 1
    return [[2 + (7 * i + j) % 50 for j in range(min_len + (5 * i) % span)] for i in range(n)]


def generate(model: SimulatedModel, config: EngineConfig, prompts, params) -> tuple[list, Engine]:
    engine = Engine(model, config)
    return engine.generate(prompts, params), engine


# ---------------------------------------------------------------------------------------------------- no torch


@pytest.mark.parametrize(
    "code",
    [
        "import labkit.core.blocks, labkit.core.scheduler, labkit.core.sim",
        "import labkit",
        "import labkit\n"
        "engine = labkit.Engine(labkit.SimulatedModel(mean_output_len=4), labkit.EngineConfig(num_blocks=16))\n"
        "outputs = engine.generate([[5, 6, 7]] * 4, labkit.SamplingParams(max_new_tokens=8), progress=True)\n"
        "assert all(o.finished for o in outputs)",
    ],
)
def test_the_engine_core_never_imports_torch(code):
    check = "\nimport sys\nheavy = sorted({'torch', 'transformers'} & set(sys.modules))\nassert not heavy, heavy\n"
    result = subprocess.run(
        [sys.executable, "-c", code + check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------------- tokens


def test_tokens_depend_only_on_the_request():
    model = SimulatedModel(vocab_size=50)
    config = EngineConfig(block_size=4, num_blocks=64)
    params = SamplingParams(max_new_tokens=20)
    first, _ = generate(model, config, [[5, 6, 7]], params)
    again, _ = generate(model, config, [[5, 6, 7]], params)
    other_seed, _ = generate(SimulatedModel(vocab_size=50, seed=1), config, [[5, 6, 7]], params)
    tokens = first[0].output_token_ids
    assert tokens == again[0].output_token_ids
    assert tokens != other_seed[0].output_token_ids
    assert len(tokens) == 20 and first[0].finish_reason == "length"
    assert all(2 <= t < 50 for t in tokens)  # never padding (0) or EOS (1) without mean_output_len
    assert len(set(tokens)) > 5  # not a constant stream


def test_a_request_gets_the_same_tokens_alone_and_in_a_batch():
    model = SimulatedModel(mean_output_len=6)
    config = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=32, max_num_seqs=8)
    prompts = make_prompts(12)
    params = [SamplingParams(max_new_tokens=4 + i % 9) for i in range(12)]
    batched, _ = generate(model, config, prompts, params)
    alone = [generate(model, config, [p], q)[0][0] for p, q in zip(prompts, params, strict=True)]
    assert [o.output_token_ids for o in batched] == [o.output_token_ids for o in alone]
    assert [o.finish_reason for o in batched] == [o.finish_reason for o in alone]
    assert {o.finish_reason for o in batched} == {"length", "stop"}  # both ways of finishing are exercised


@pytest.mark.parametrize("chunked_prefill", [True, False])
def test_a_preempted_request_gets_the_same_tokens_as_without_preemption(chunked_prefill):
    model = SimulatedModel(mean_output_len=12)
    prompts = make_prompts(10, min_len=4, max_len=10)
    params = SamplingParams(max_new_tokens=14)
    # 12 blocks of 2 slots: any one request fits (at most 10 + 14 - 1 = 23 slots), ten of them do not.
    small = EngineConfig(
        block_size=2, num_blocks=12, max_batch_tokens=32, max_num_seqs=8, chunked_prefill=chunked_prefill
    )
    big = EngineConfig(block_size=2, num_blocks=1024, max_batch_tokens=32, max_num_seqs=8)
    squeezed, _ = generate(model, small, prompts, params)
    roomy, _ = generate(model, big, prompts, params)
    assert sum(o.metrics.num_preemptions for o in squeezed) > 0, "the small cache should force preemptions"
    assert sum(o.metrics.num_preemptions for o in roomy) == 0
    assert [o.output_token_ids for o in squeezed] == [o.output_token_ids for o in roomy]
    assert [o.finish_reason for o in squeezed] == [o.finish_reason for o in roomy]


def test_mean_output_len_sets_the_average_length():
    # Each token is EOS with probability 1 / mean, so lengths (EOS included) are geometric with that mean.
    model = SimulatedModel(mean_output_len=8)
    prompts = [[2 + i % 97, 3 + i % 89, 4 + i % 83] + [5] * (i % 5) for i in range(2000)]
    config = EngineConfig(block_size=16, num_blocks=4096, max_batch_tokens=4096, max_num_seqs=512)
    outputs, _ = generate(model, config, prompts, SamplingParams(max_new_tokens=200))
    lengths = [len(o.output_token_ids) for o in outputs]
    assert 7 < sum(lengths) / len(lengths) < 9
    assert max(lengths) > 3 * 8  # long-tailed
    stopped_early = [o for o in outputs if len(o.output_token_ids) < 200]
    assert all(o.finish_reason == "stop" and o.output_token_ids[-1] == EOS for o in stopped_early)


# ---------------------------------------------------------------------------------------------------- clock


def test_step_time_follows_the_cost_model():
    cost = CostModel("toy", base=1.0, per_token=0.1, per_kv_token=0.01)
    config = EngineConfig(block_size=4, num_blocks=16, max_batch_tokens=16, max_num_seqs=4)
    engine = Engine(SimulatedModel(cost=cost), config)
    engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=2))
    engine.add_request([9, 10], SamplingParams(max_new_tokens=2))
    prefill, decode = engine.step(), engine.step()
    # Prefill: 4 + 2 tokens computed, attending over 4 + 2 cached tokens: 1 + 0.1 * 6 + 0.01 * 6.
    assert prefill.start_time == 0.0
    assert prefill.duration == pytest.approx(1.66)
    # Decode: one token each, at positions 4 and 2, attending over 5 + 3 tokens: 1 + 0.1 * 2 + 0.01 * 8.
    assert decode.start_time == pytest.approx(1.66)
    assert decode.duration == pytest.approx(1.28)
    assert engine.requests[0].metrics.first_token_time == pytest.approx(1.66)
    assert engine.requests[0].metrics.finish_time == pytest.approx(1.66 + 1.28)


def test_static_padding_costs_time():
    cost = CostModel("toy", base=1.0, per_token=0.1, per_kv_token=0.0)
    config = EngineConfig(policy="static", block_size=4, num_blocks=16, max_batch_tokens=16, max_num_seqs=4)
    engine = Engine(SimulatedModel(cost=cost), config)
    engine.add_request([5, 6, 7, 8], SamplingParams(max_new_tokens=1))
    engine.add_request([9], SamplingParams(max_new_tokens=1))
    report = engine.step()
    # Two prompts padded to 4 rows each: 8 rows computed, 3 of them padding.
    assert report.wasted_slots == 3
    assert report.duration == pytest.approx(1.0 + 0.1 * 8)


def test_continuous_batching_beats_static_on_long_tailed_outputs():
    model = SimulatedModel(mean_output_len=16)
    prompts = make_prompts(64, min_len=4, max_len=32)
    params = SamplingParams(max_new_tokens=128)
    runs = {}
    for policy in ("continuous", "static"):
        config = EngineConfig(policy=policy, block_size=16, num_blocks=1024, max_batch_tokens=512, max_num_seqs=16)
        outputs, engine = generate(model, config, prompts, params)
        runs[policy] = ([o.output_token_ids for o in outputs], engine.clock())
    assert runs["continuous"][0] == runs["static"][0]  # same tokens, only the schedule differs
    assert runs["continuous"][1] < runs["static"][1]


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 2}, "vocab_size must be >= 3"),
        ({"cost": "tpu"}, "unknown cost preset 'tpu'"),
        ({"mean_output_len": 0.5}, "mean_output_len must be a finite number >= 1"),
    ],
)
def test_bad_simulated_model_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SimulatedModel(**kwargs)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"base": -0.5}, ValueError, "base must be a finite number of seconds >= 0, got -0.5"),
        ({"per_token": float("nan")}, ValueError, "per_token must be a finite number of seconds >= 0, got nan"),
        ({"per_kv_token": float("inf")}, ValueError, "per_kv_token must be a finite number of seconds >= 0"),
        ({"host_base": -1e-6}, ValueError, "host_base must be a finite number of seconds >= 0"),
        ({"base": "0.1"}, TypeError, "base must be a number of seconds, got str '0.1'"),
        ({"host_per_request": True}, TypeError, "host_per_request must be a number of seconds, got bool"),
        ({"name": None}, TypeError, "name must be a str, got NoneType"),
    ],
)
def test_a_cost_that_would_break_the_simulated_clock_is_refused(fields, error, match):
    """A negative or NaN cost would run the clock backwards or lose it; text would fail only at the first step."""
    with pytest.raises(error, match=re.escape(match)):
        CostModel(**{"name": "toy", "base": 1.0, "per_token": 0.0, "per_kv_token": 0.0, **fields})


def test_a_cost_model_takes_any_real_number_and_stores_a_float():
    cost = CostModel("toy", base=1, per_token=Fraction(1, 4), per_kv_token=0, host_base=0.0)
    assert (cost.base, cost.per_token, cost.per_kv_token) == (1.0, 0.25, 0.0)
    assert all(type(getattr(cost, f)) is float for f in ("base", "per_token", "per_kv_token", "host_per_request"))


def test_host_time_adds_to_a_step_and_overlaps_it_with_async_scheduling():
    """Host and device one after the other: a step takes their sum; planned ahead, the longer of the two."""
    cost = CostModel("toy", base=1.0, per_token=0.1, per_kv_token=0.0, host_base=0.5, host_per_request=0.25)
    times = {}
    for ahead in (False, True):
        config = EngineConfig(block_size=4, num_blocks=64, max_batch_tokens=16, max_num_seqs=4, async_scheduling=ahead)
        engine = Engine(SimulatedModel(cost=cost), config)
        for i in range(4):
            engine.add_request([5, 6, i + 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
        reports = []
        while engine.has_unfinished():
            reports.append(engine.step())
        decode_ends = [r.end_time for r in reports if r.num_prefill_tokens == 0]
        times[ahead] = [b - a for a, b in itertools.pairwise(decode_ends)]
    # A decode step of 4 requests: device 1 + 0.1 * 4 = 1.4 s, host 0.5 + 0.25 * 4 = 1.5 s.
    assert times[False] == pytest.approx([2.9] * len(times[False]))
    # Planned ahead, a step takes the longer of the two, and its tokens are stamped when it ended.
    assert times[True] == pytest.approx([1.5] * len(times[True]))
    assert len(times[True]) == len(times[False]) > 2
    assert COST_PRESETS["h200"].host_time(256) == 0.0  # the presets from before charge no host time


def run_sim_bench(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "sim_bench.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_the_simulated_benchmark_compares_both_policies_on_the_same_subset():
    done = run_sim_bench("--requests", "60", "--static-requests", "20")
    assert done.returncode == 0, done.stderr
    rows = [line.split("│")[1:4] for line in done.stdout.splitlines() if line.startswith("│ ")]
    policies = [(cells[0].strip(), cells[1].strip()) for cells in rows]
    assert policies == [("continuous", "60"), ("continuous", "20"), ("static", "20")]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--max-new-tokens", "0"), "max_new_tokens must be >= 1, got 0"),
        (("--mean-output-len", "0"), "mean_output_len must be a finite number >= 1"),
        (("--block-size", "0"), "block_size must be >= 1, got 0"),
        (("--requests", "0"), "--requests must be >= 1, got 0"),
    ],
)
def test_the_simulated_benchmark_names_a_bad_option_without_a_traceback(args, message):
    done = run_sim_bench(*args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
