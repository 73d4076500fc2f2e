"""Differential fuzz: the engine's features combined at random still give ``model.generate``'s tokens.

The parity tests elsewhere switch features on mostly one at a time; a bug that needs two of them together
(prefix caching and preemption under a priority queue, async scheduling and an abort, a one-token budget
and a sliding window) slips between them. Here hypothesis draws the whole configuration at once: the
architecture (Mistral with a sliding window shorter than the contexts), block size, a cache from barely
enough for the largest request (preemptions) to plenty, token budgets down to one token, seats, both
policies, chunked prefill, prefix caching over prompts that share prefixes (whole blocks, a prompt that is
a prefix of another, identical ones), all scheduling orders with random priorities, async scheduling,
stop tokens and EOS, requests that arrive between steps and aborts. Greedy requests must produce
transformers' tokens for each prompt alone and a seeded sampled one the tokens it draws alone; after the
run nothing leaks and the step reports add up. Derandomized and small, so that it runs the same cases
every time, in seconds; the same driver with more examples (and other seeds) is the long fuzz run.
Threads: torch runs on 1 thread (conftest).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit import Engine, EngineConfig, SamplingParams
from labkit.core.blocks import blocks_for
from labkit.core.config import SCHEDULING

ARCHS = {"llama": {}, "qwen3": {}, "mistral": {"sliding_window": 7}}
VOCAB = 96  # a small vocabulary: outputs repeat tokens, so stop tokens and EOS are hit
MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def models(tiny_model: Any) -> dict[str, Any]:
    return {arch: tiny_model(arch, seed=3, vocab_size=VOCAB, **overrides) for arch, overrides in ARCHS.items()}


@pytest.fixture(scope="module")
def reference(models: dict[str, Any], greedy_reference: Any) -> Any:
    """``reference(arch, prompt)``: transformers' greedy tokens (EOS ignored), computed once per prompt."""
    known: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def tokens(arch: str, prompt: list[int]) -> list[int]:
        key = (arch, tuple(prompt))
        if key not in known:
            known[key] = greedy_reference(models[arch], prompt, MAX_NEW_TOKENS)
        return known[key]

    return tokens


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    """Prompts sharing prefixes, when each arrives, the configuration, and which requests are aborted when."""
    block_size = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 32]))
    base = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40))
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["own", "whole blocks", "shared", "earlier"]))
        if kind == "earlier" and prompts:  # identical to an earlier prompt, or a prefix of one
            earlier = draw(st.sampled_from(prompts))
            prompt = earlier[: draw(st.integers(1, len(earlier)))]
        elif kind == "whole blocks":
            prompt = base[: block_size * draw(st.integers(0, len(base) // block_size))]
        elif kind == "shared":
            prompt = base[: draw(st.integers(0, len(base)))]
        else:
            prompt = []
        prompt = prompt + draw(st.lists(st.integers(3, VOCAB - 1), min_size=0 if prompt else 1, max_size=12))
        prompts.append(prompt)
    policy = draw(st.sampled_from(["continuous", "static"]))
    continuous = policy == "continuous"
    max_batch_tokens = draw(st.sampled_from([1, 2, 3, 5, 8, 16, 64]))
    return {
        "arch": draw(st.sampled_from(list(ARCHS))),
        "prompts": prompts,
        "arrivals": [draw(st.integers(0, 4)) for _ in prompts],  # the step before which each is added
        "aborts": draw(st.dictionaries(st.integers(0, len(prompts) - 1), st.integers(0, 12), max_size=2)),
        "sampled": draw(st.one_of(st.none(), st.integers(0, len(prompts) - 1))),  # one seeded sampled request
        "extra_blocks": draw(st.sampled_from([0, 1, 3, 100])),
        "options": {
            "block_size": block_size,
            "max_batch_tokens": max_batch_tokens,
            "max_num_seqs": draw(st.integers(1, min(8, max_batch_tokens))),
            "policy": policy,
            "chunked_prefill": draw(st.booleans()),
            "enable_prefix_caching": continuous and draw(st.booleans()),
            "scheduling": draw(st.sampled_from(SCHEDULING)),
            "async_scheduling": continuous and draw(st.booleans()),
        },
    }


def expected(tokens: list[int], params: SamplingParams, eos: int) -> tuple[list[int], str]:
    """What the engine must produce for a prompt whose greedy continuation (EOS ignored) is ``tokens``."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
    for i, token in enumerate(tokens[: params.max_new_tokens]):
        if token in stops:
            return tokens[: i + 1], "stop"
    return tokens[: params.max_new_tokens], "length"


def run(engine: Engine, prompts: list, params: list, arrivals: list, aborts: dict) -> tuple[dict, list, set]:
    """Add each request before its arrival step, abort as told, step to the end; (outputs, reports, aborted)."""
    reports: list = []
    engine.step_listeners.append(reports.append)
    ids: dict[int, int] = {}
    aborted = set()
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                try:
                    ids[i] = engine.add_request(prompts[i], params[i])
                except ValueError as error:  # a request this configuration can never finish, refused whole
                    assert "max_batch_tokens" in str(error) or "cache slots" in str(error), error
        for i, when in aborts.items():
            if when == step and i in ids and ids[i] in engine.scheduler.requests:
                engine.abort(ids[i])
                aborted.add(i)
        engine.step()
        step += 1
        assert step < 2000, "the run does not finish"
    outputs = {i: engine.release(request_id) for i, request_id in ids.items()}
    return outputs, reports, aborted


def check_reports(reports: list, outputs: dict, engine: Engine) -> None:
    """Budgets and seats hold every step, each request finishes once with the tokens its steps reported, and the
    free-block counts agree with the block events."""
    config, refs = engine.config, [0] * engine.num_blocks
    generated: dict[int, list[int]] = {}
    finished: Counter = Counter()
    for report in reports:
        rows = [*report.scheduled, *report.padding]
        assert sum(w.num_tokens for w in rows) <= config.max_batch_tokens, f"step {report.step}: over budget"
        assert len({w.request_id for w in rows}) <= config.max_num_seqs, f"step {report.step}: too many requests"
        assert report.num_running <= config.max_num_seqs, f"step {report.step}: too many running"
        for work in report.scheduled:
            if work.token is not None:
                generated.setdefault(work.request_id, []).append(work.token)
        finished.update(report.finished.keys())
        for event in report.block_events:
            refs[event.block_id] += {"alloc": 1, "hit": 1, "free": -1, "release": -1}.get(event.kind, 0)
            assert refs[event.block_id] >= 0, f"step {report.step}: {event} on a block nobody holds"
        assert report.num_free_blocks == refs.count(0), f"step {report.step}: free blocks and block events disagree"
    assert finished == Counter(o.request_id for o in outputs.values()), "every request finishes once"
    for output in outputs.values():
        assert generated.get(output.request_id, []) == output.output_token_ids
    assert engine.num_free_blocks == engine.num_blocks and not engine.has_unfinished()


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(case=workloads(), data=st.data())
def test_random_feature_combinations_match_generate(models: dict, reference: Any, case: dict, data: Any) -> None:
    model, prompts = models[case["arch"]], case["prompts"]
    references = [reference(case["arch"], prompt) for prompt in prompts]
    eos = data.draw(st.sampled_from([2, *references[0]]), label="eos")  # 2 is the model's own, seldom generated
    params = []
    for i, tokens in enumerate(references):
        stop = data.draw(st.sampled_from([(), (tokens[0],), (tokens[-1],)]), label=f"stop tokens {i}")
        sampling = {"temperature": 1.0, "seed": i} if case["sampled"] == i else {}
        params.append(
            SamplingParams(
                max_new_tokens=data.draw(st.integers(1, MAX_NEW_TOKENS), label=f"max_new_tokens {i}"),
                stop_token_ids=stop,
                ignore_eos=data.draw(st.booleans(), label=f"ignore_eos {i}"),
                priority=data.draw(st.integers(0, 3), label=f"priority {i}"),
                **sampling,
            )
        )
    options = case["options"]
    block_size = options["block_size"]
    largest = max(blocks_for(len(p) + q.max_new_tokens - 1, block_size) for p, q in zip(prompts, params, strict=True))
    config = EngineConfig(num_blocks=largest + case["extra_blocks"], device="cpu", **options)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = eos  # the engine reads the model's EOS when it is built
    try:
        engine = Engine(model, config)
        alone = None if case["sampled"] is None else Engine(model, EngineConfig(num_blocks=64, device="cpu"))
    finally:
        model.generation_config.eos_token_id = saved
    outputs, reports, aborted = run(engine, prompts, params, case["arrivals"], case["aborts"])
    for i, output in outputs.items():
        tokens, reason = output.output_token_ids, output.finish_reason
        if params[i].greedy:
            want, why = expected(references[i], params[i], eos)
        else:  # seeded sampling: the tokens it draws alone, whatever the crowd, the budget, preemptions
            assert alone is not None
            (by_itself,) = alone.generate([prompts[i]], params[i])
            want, why = by_itself.output_token_ids, by_itself.finish_reason
        if i in aborted:
            assert reason == "abort" and tokens == want[: len(tokens)], f"request {i}"
        else:
            assert (tokens, reason) == (want, why), f"request {i}"
    check_reports(reports, outputs, engine)
