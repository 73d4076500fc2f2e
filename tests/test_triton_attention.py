"""The Triton paged-attention kernels against the plain-torch path, on random inputs.

On CUDA the kernels run natively; elsewhere through Triton's interpreter, which must be switched on
before triton is first imported (conftest.py sets TRITON_INTERPRET=1 on machines without an NVIDIA GPU;
the line below covers running this file alone). Shapes stay small so that the interpreter finishes quickly.
"""

from __future__ import annotations

import os
import random
from array import array
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from labkit import Engine, EngineConfig, SamplingParams
from labkit.core.blocks import blocks_for
from labkit.models.random import random_model
from labkit.runtime import triton_attention
from labkit.runtime.attention import PagedKVCache, Segment, build_paged_batch, paged_attention_forward
from labkit.runtime.cuda_graphs import bucket_sizes
from labkit.runtime.runner import interpreter_runs_kernels
from labkit.runtime.triton_attention import (
    StepUploader,
    build_triton_batch,
    store_kv,
    triton_attention_forward,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":
    pytest.skip("triton_attention was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
if DEVICE.type == "cpu" and not interpreter_runs_kernels():
    pytest.skip("this triton's interpreter cannot run the kernels (needs triton>=3.7)", allow_module_level=True)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
LAYER = SimpleNamespace(layer_idx=0)


def random_step(rng: random.Random, specs: list[tuple[int, int]], block_size: int, num_blocks: int) -> list[Segment]:
    """Segments for (cached tokens, new tokens) pairs, each over randomly chosen, disjoint blocks."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    segments = []
    for cached, new in specs:
        used = blocks_for(cached + new, block_size)
        segments.append(Segment(cached, new, [free.pop() for _ in range(used)]))
    return segments


def run_both(
    specs: list[tuple[int, int]],
    *,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, PagedKVCache, PagedKVCache]:
    """The same step through the torch path (in float32) and the Triton kernels (in ``dtype``)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    num_kv_heads = 2 if group < 8 else 1
    num_blocks = sum(blocks_for(c + n, block_size) for c, n in specs) + 3
    segments = random_step(rng, specs, block_size, num_blocks)
    num_tokens = sum(n for _, n in specs)
    query = torch.randn(1, num_kv_heads * group, num_tokens, head_dim, generator=generator)
    key = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=generator)
    value = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=generator)
    reference_cache = PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, DEVICE)
    triton_cache = PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype, DEVICE)
    # Cached keys and values, and noise in every other slot; both caches hold the same (rounded) values.
    contents = torch.randn(reference_cache.data.shape, generator=generator).to(dtype)
    triton_cache.data.copy_(contents)
    reference_cache.data.copy_(contents.float())
    q, k, v = (t.to(DEVICE) for t in (query, key, value))
    batch = build_paged_batch(reference_cache, segments, DEVICE)
    expected, _ = paged_attention_forward(LAYER, q, k, v, None, sliding_window=window, paged_batch=batch)
    token_ids = [0] * num_tokens
    _, triton_batch, _ = build_triton_batch(triton_cache, segments, token_ids, [], StepUploader(DEVICE))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    got, _ = triton_attention_forward(LAYER, q, k, v, None, sliding_window=window, paged_batch=triton_batch)
    return expected, got, reference_cache, triton_cache


MIXED = [(0, 9), (21, 1), (5, 12), (40, 1), (0, 1), (16, 3)]  # fresh prompt, decodes, later chunks


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_matches_torch_on_a_mixed_step(group: int, head_dim: int, block_size: int) -> None:
    expected, got, reference_cache, triton_cache = run_both(
        MIXED, group=group, head_dim=head_dim, block_size=block_size, seed=group + head_dim + block_size
    )
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)
    torch.testing.assert_close(triton_cache.data, reference_cache.data, atol=0, rtol=0)  # same stores


@pytest.mark.parametrize("tile, num_warps", [(16, 2), (64, 8)])
def test_other_launch_shapes_and_64_bit_offsets_give_the_same_result(
    tile: int, num_warps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a benchmark sweeps (tile, warps) and what a cache too big for 32-bit offsets uses change no result."""
    expected, default, _, _ = run_both(MIXED, group=4, head_dim=64, block_size=16, seed=3)
    monkeypatch.setattr(triton_attention, "WIDE_OFFSETS_FROM", 1)
    original = triton_attention.paged_attention

    def with_shape(*args, **kwargs):
        return original(*args, **kwargs, tile=tile, num_warps=num_warps)

    monkeypatch.setattr(triton_attention, "paged_attention", with_shape)
    _, got, _, _ = run_both(MIXED, group=4, head_dim=64, block_size=16, seed=3)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)
    torch.testing.assert_close(got, default, atol=TOLERANCE[torch.float32], rtol=0)


DECODES = [(0, 1), (2, 1), (37, 1), (130, 1), (64, 1)]  # decode rows over 1 to 131 keys


def forcing_splits(monkeypatch: pytest.MonkeyPatch, num_splits: int) -> None:
    """Make every decode step split its contexts, as a GPU does for a small batch (a CPU never splits)."""
    original = triton_attention.paged_attention

    def split(*args, **kwargs):
        return original(*args, **kwargs, num_splits=num_splits)

    monkeypatch.setattr(triton_attention, "paged_attention", split)


@pytest.mark.parametrize("num_splits", [2, 3, 16])
@pytest.mark.parametrize("group, head_dim", [(1, 64), (7, 64), (4, 128)])
def test_a_decode_step_split_into_parts_matches_torch(
    group: int, head_dim: int, num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16 parts of a 1-key context leave 15 parts empty; 3 rounds up to 4; every part is merged by its weight."""
    forcing_splits(monkeypatch, 1)  # a GPU would split this small batch by itself
    expected, unsplit, _, _ = run_both(DECODES, group=group, head_dim=head_dim, block_size=16, seed=num_splits)
    monkeypatch.undo()
    forcing_splits(monkeypatch, num_splits)
    _, got, _, _ = run_both(DECODES, group=group, head_dim=head_dim, block_size=16, seed=num_splits)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)
    torch.testing.assert_close(got, unsplit, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_split_decode_in_half_precision_and_a_sliding_window(dtype: torch.dtype, monkeypatch) -> None:
    expected, _, _, _ = run_both(DECODES, group=4, head_dim=64, block_size=16, window=40, seed=5)
    forcing_splits(monkeypatch, 4)
    _, got, _, _ = run_both(DECODES, group=4, head_dim=64, block_size=16, dtype=dtype, window=40, seed=5)
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_decode_splits_fill_the_gpu_only_when_the_batch_cannot() -> None:
    sms = 132  # an H100/H200
    assert triton_attention.decode_splits(2, sms) == 16  # batch 1, 2 KV heads: capped
    assert triton_attention.decode_splits(128, sms) == 4  # batch 64: 264 / 128, rounded up to a power of two
    assert triton_attention.decode_splits(264, sms) == 1  # two programs per SM already
    assert triton_attention.decode_splits(512, sms) == 1
    assert triton_attention.decode_splits(80, 40) == 1  # a T4's 40 SMs, batch 40 x 2 KV heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_precision_within_tolerance(dtype: torch.dtype) -> None:
    expected, got, _, _ = run_both(MIXED, group=4, head_dim=64, block_size=16, dtype=dtype, seed=7)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("window", [4, 20])
def test_sliding_window(window: int) -> None:
    specs = [(0, 30), (50, 1), (33, 7)]
    expected, got, _, _ = run_both(specs, group=4, head_dim=64, block_size=16, window=window, seed=window)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)
    # The window matters: without it the outputs differ.
    unwindowed, _, _, _ = run_both(specs, group=4, head_dim=64, block_size=16, seed=window)
    assert not torch.allclose(unwindowed, expected)


def test_a_non_power_of_two_group_and_head_dim() -> None:
    """Qwen2.5-0.5B packs 7 query heads per KV head; head sizes such as 80 pad to the next power of two."""
    expected, got, _, _ = run_both(MIXED, group=7, head_dim=80, block_size=16, seed=3)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=0)


@pytest.mark.parametrize("num_tokens", [1, 5, 38])
def test_every_metadata_tensor_starts_on_16_bytes(num_tokens: int) -> None:
    """Triton compiles a kernel variant per pointer alignment: odd step sizes must not shift the metadata."""
    cache = PagedKVCache(1, 16, 4, 1, 16, torch.float32, DEVICE)
    segments = [Segment(3, num_tokens, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]), Segment(2, 1, [12])]
    sample_rows = [num_tokens - 1, num_tokens]
    ids, batch, keep = build_triton_batch(cache, segments, [7] * (num_tokens + 1), sample_rows, StepUploader(DEVICE))
    tensors = [ids, batch.position_ids, batch.slot_mapping, batch.query_start_loc, batch.seq_lens, batch.block_tables]
    if num_tokens > 1:
        tensors.append(keep)
        assert keep.tolist() == sample_rows
    base = ids.data_ptr()
    assert all((t.data_ptr() - base) % 16 == 0 for t in tensors)
    assert batch.position_ids.tolist() == [*range(3, 3 + num_tokens), 2]
    assert batch.query_start_loc.tolist() == [0, num_tokens, num_tokens + 1]
    assert batch.seq_lens.tolist() == [3 + num_tokens, 3]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the race needs an asynchronous copy")
def test_a_second_upload_waits_until_the_first_copy_has_read_the_pinned_buffer() -> None:
    uploader = StepUploader(DEVICE)
    torch.cuda._sleep(200_000_000)  # the GPU is busy: the first copy is queued, not done
    first = uploader.upload(array("i", [1] * 1000))
    second = uploader.upload(array("i", [2] * 1000))  # same pinned buffer
    assert first.tolist() == [1] * 1000 and second.tolist() == [2] * 1000


def test_store_skips_padded_slots_and_padded_rows_attend_to_nothing() -> None:
    cache = PagedKVCache(1, 4, 16, 2, 64, torch.float32, DEVICE)
    key_cache, value_cache = cache.parts[0]
    key = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([5, -1, 17], dtype=torch.int32, device=DEVICE)
    store_kv(key, key + 1, key_cache, value_cache, slots)
    flat_keys = key_cache.reshape(2, -1, 64)
    torch.testing.assert_close(flat_keys[:, 5], key[0])
    torch.testing.assert_close(flat_keys[:, 17], key[2])
    assert int((flat_keys.abs().sum(-1) > 0).sum()) == 4  # two slots x two heads, nothing for the -1 row
    # Two decode rows, the second padded (no context): its output is zeros, not NaN, split or not.
    query = torch.randn(2, 8, 64, device=DEVICE)
    metadata = [torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in ([0, 1, 2], [6, 0], [[0], [0]])]

    def attend(num_splits: int | None = None) -> torch.Tensor:
        args = (query, key_cache, value_cache, *metadata, 0.125)
        return triton_attention.paged_attention(*args, max_query_len=1, num_splits=num_splits)

    out = attend(num_splits=1)  # unsplit (a GPU would split two rows by itself)
    assert torch.isfinite(out).all() and not out[0].eq(0).all() and out[1].eq(0).all()
    torch.testing.assert_close(attend(num_splits=4), out, atol=TOLERANCE[torch.float32], rtol=0)
    with pytest.raises(ValueError, match="num_splits"):
        attend(num_splits=32)


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(24) == [1, 2, 4, 8, 16, 24]


def generate(
    model: torch.nn.Module, prompts: list[list[int]], wanted: list[int], **options: object
) -> tuple[list[list[int]], int]:
    """Greedy tokens of every request, and how many preemptions the run had."""
    # A cache of a fixed size: sized from a large GPU's free memory it would take the kernel's 64-bit offsets.
    options = {"num_blocks": 1024, **options}
    config = EngineConfig(block_size=8, max_batch_tokens=24, max_num_seqs=5, device=DEVICE.type, **options)
    engine = Engine(model, config)
    preempted = []
    engine.step_listeners.append(lambda report: preempted.extend(report.preempted))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    return [o.output_token_ids for o in engine.generate(prompts, params)], len(preempted)


def test_engine_triton_backend_matches_torch_and_graph_replays() -> None:
    """Greedy tokens: torch path, Triton path, and Triton with decode graphs (bucket sizes 1, 2, 4, 5 are all
    used as requests finish; the 3-block cache of a 24-token budget forces preemption and recomputation)."""
    model = random_model("qwen2", "tiny", num_hidden_layers=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(3, 20))] for _ in range(6)]
    wanted = [3, 9, 14, 5, 18, 7]
    expected, _ = generate(model, prompts, wanted, attention_backend="torch")
    assert generate(model, prompts, wanted, attention_backend="triton", use_cuda_graph=False) == (expected, 0)
    tokens, preemptions = generate(
        model, prompts, wanted, attention_backend="triton", use_cuda_graph=True, num_blocks=9
    )
    assert tokens == expected and preemptions > 0


def test_graph_steps_with_static_padding_and_one_token_prompt_chunks_match_torch() -> None:
    """Decode graphs also serve steps whose rows are not all sampling decodes: a static batch's finished members
    (padding rows that store nothing) and, with a budget of one token beyond three decodes, a prompt fed one
    token a step, whose rows sample nothing until its last one."""
    model = random_model("qwen2", "tiny", num_hidden_layers=1)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in (2, 2, 2, 9, 7, 8)]
    wanted = [14, 14, 14, 5, 3, 6]
    for policy, options in (("static", {}), ("continuous", {"max_batch_tokens": 4, "chunked_prefill": True})):
        config = {"policy": policy, "block_size": 8, "num_blocks": 1024, "max_num_seqs": 4, "device": DEVICE.type}
        config |= options
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
        expected = Engine(model, EngineConfig(attention_backend="torch", **config)).generate(prompts, params)
        engine = Engine(model, EngineConfig(attention_backend="triton", use_cuda_graph=True, **config))
        reports: list = []
        engine.step_listeners.append(reports.append)
        got = engine.generate(prompts, params)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in expected], policy
        graph_steps = [r for r in reports if r.scheduled and all(w.num_tokens == 1 for w in r.scheduled + r.padding)]
        assert engine.runner.graphs.num_replays == len(graph_steps) > 0
        if policy == "static":
            assert any(r.padding for r in graph_steps)
        else:
            assert any(w.is_prefill and w.token is None for r in graph_steps for w in r.scheduled)


def test_engine_with_split_decodes_generates_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step split in 4, graphs on: the same greedy tokens as the torch path."""
    model = random_model("qwen2", "tiny", num_hidden_layers=1)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    wanted = [6, 3, 9, 5]
    expected, _ = generate(model, prompts, wanted, attention_backend="torch")
    forcing_splits(monkeypatch, 4)
    assert generate(model, prompts, wanted, attention_backend="triton", use_cuda_graph=True) == (expected, 0)


def test_backend_and_graph_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from labkit.runtime.runner import resolve_attention_backend, resolve_use_cuda_graph

    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(TypeError, match="use_cuda_graph"):
        EngineConfig(use_cuda_graph="yes")
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"  # the CPU path never changes by default
    assert resolve_use_cuda_graph(None, "torch", cpu) is False
    with pytest.raises(ValueError, match="needs attention_backend='triton'"):
        resolve_use_cuda_graph(True, "torch", cpu)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", cpu)


def test_cuda_graphs_default_to_on_only_for_triton_on_cuda_and_asking_for_them_needs_triton() -> None:
    from labkit.runtime.runner import resolve_use_cuda_graph

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_use_cuda_graph(None, "triton", gpu) is True
    assert resolve_use_cuda_graph(None, "torch", gpu) is False
    assert resolve_use_cuda_graph(None, "triton", cpu) is False
    assert resolve_use_cuda_graph(True, "triton", cpu) is True  # replays simulated under the interpreter
    assert resolve_use_cuda_graph(False, "torch", gpu) is False


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "sliding_attention": {}},
    ],
    ids=["dynamic", "dynamic, per layer type"],
)
def test_a_rope_that_syncs_the_host_turns_cuda_graphs_off_by_default_and_refuses_them_when_asked(rope) -> None:
    """Dynamic RoPE decides on the host, per step, from the GPU's positions: a graph capture would fail on it."""
    from labkit.runtime.runner import graph_blocker, resolve_use_cuda_graph

    gpu = torch.device("cuda")
    scaled = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(rope_parameters=rope)))
    plain = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: SimpleNamespace(rope_parameters={})))
    assert graph_blocker(plain) is None and "'dynamic' RoPE" in graph_blocker(scaled)
    assert resolve_use_cuda_graph(None, "triton", gpu, plain) is True
    assert resolve_use_cuda_graph(None, "triton", gpu, scaled) is False
    assert resolve_use_cuda_graph(False, "triton", gpu, scaled) is False
    with pytest.raises(ValueError, match="use_cuda_graph=True: its 'dynamic' RoPE"):
        resolve_use_cuda_graph(True, "triton", gpu, scaled)


def test_triton_needs_its_package_and_on_a_cpu_an_interpreter_that_runs_the_kernels(monkeypatch) -> None:
    import importlib.metadata

    from labkit.runtime import runner

    def installed(version):
        real_version = importlib.metadata.version
        monkeypatch.setattr(
            runner.importlib.metadata, "version", lambda name: version if name == "triton" else real_version(name)
        )

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(runner.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(runner, "missing_build_tools", str)  # a machine that has them
    installed("3.7.0")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert runner.resolve_attention_backend("triton", gpu) == "triton"  # a GPU needs no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert runner.resolve_attention_backend("triton", cpu) == "triton"
    installed("3.6.0")
    with pytest.raises(ValueError, match=r"needs triton>=3\.7: the interpreter of triton 3\.6\.0 cannot run"):
        runner.resolve_attention_backend("triton", cpu)
    real_find_spec = runner.importlib.util.find_spec
    monkeypatch.setattr(
        runner.importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    assert runner.resolve_attention_backend("auto", gpu) == "torch"
    with pytest.raises(ValueError, match="needs the triton package"):
        runner.resolve_attention_backend("triton", gpu)


@pytest.mark.parametrize(
    ("version", "capability", "why"),
    [
        ("3.6.0", (9, 0), ""),
        ("3.5.1", (9, 0), "labkit's kernels need triton>=3.6, this is 3.5.1"),
        ("3.6.0", (7, 0), "built for compute capability 7.5 and newer, this GPU has 7.0"),
        (None, (9, 0), "need the triton package, which is not installed (pip install 'labkit-batching[gpu]')"),
    ],
    ids=["runs", "old-triton", "old-gpu", "no-triton"],
)
def test_why_no_triton_says_why_auto_takes_the_torch_attention_on_a_gpu(monkeypatch, version, capability, why):
    """What a notebook prints beside attention_backend='torch' (and no CUDA graphs) on CUDA: the reason, which
    "auto" acts on; "" where the Triton kernels run."""
    import importlib.metadata

    from labkit.runtime import runner

    real_version, real_find_spec = importlib.metadata.version, runner.importlib.util.find_spec
    monkeypatch.setattr(
        runner.importlib.metadata, "version", lambda name: version if name == "triton" else real_version(name)
    )
    monkeypatch.setattr(
        runner.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "triton" and version is None else real_find_spec(name, *a),
    )
    monkeypatch.setattr(runner.torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(runner, "missing_build_tools", str)  # a machine that has them
    gpu = torch.device("cuda")
    said = runner.why_no_triton(gpu)
    assert (why in said) if why else said == ""
    assert runner.resolve_attention_backend("auto", gpu) == ("torch" if why else "triton")


@pytest.mark.parametrize(
    ("version", "capability", "expected"),
    [("3.6.0", (9, 0), "triton"), ("3.6.0", (7, 5), "triton"), ("3.5.1", (9, 0), "torch"), ("3.6.0", (7, 0), "torch")],
)
def test_auto_picks_triton_only_on_a_gpu_it_builds_for(monkeypatch, version, capability, expected) -> None:
    """An H200 or a T4 with triton >= 3.6: Triton. An older triton, or a GPU older than sm75: the torch path,
    where asking for Triton outright says why."""
    import importlib.metadata

    from labkit.runtime import runner

    pytest.importorskip("triton")

    real_version = importlib.metadata.version
    monkeypatch.setattr(
        runner.importlib.metadata, "version", lambda name: version if name == "triton" else real_version(name)
    )
    monkeypatch.setattr(runner.torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(runner, "missing_build_tools", str)  # a machine that has them
    gpu = torch.device("cuda")
    assert runner.resolve_attention_backend("auto", gpu) == expected
    if expected == "torch":
        with pytest.raises(ValueError, match="use attention_backend='torch'"):
            runner.resolve_attention_backend("triton", gpu)
    else:
        assert runner.resolve_attention_backend("triton", gpu) == "triton"


def test_without_a_c_compiler_or_pythons_headers_auto_picks_torch_and_says_why(monkeypatch, tmp_path) -> None:
    """Triton builds a C launcher for each kernel on first use: on an image without gcc or Python.h the engine
    must fall back to the torch attention before its first step, not fail inside it."""
    from labkit.runtime import runner

    pytest.importorskip("triton")
    monkeypatch.setattr(runner.importlib.metadata, "version", lambda name: "3.6.0")
    monkeypatch.setattr(runner.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda")
    (tmp_path / "Python.h").write_text("")
    monkeypatch.setattr(runner.sysconfig, "get_paths", lambda scheme=None: {"include": str(tmp_path)})
    monkeypatch.setattr(runner.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert runner.missing_build_tools() == ""
    assert runner.resolve_attention_backend("auto", gpu) == "triton"

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(runner.shutil, "which", lambda name: None)
    assert "C compiler" in runner.missing_build_tools()
    assert runner.resolve_attention_backend("auto", gpu) == "torch"
    with pytest.raises(ValueError, match=r"none is installed.*use attention_backend='torch'"):
        runner.resolve_attention_backend("triton", gpu)
    monkeypatch.setenv("CC", "cc")  # Triton takes $CC first
    assert runner.missing_build_tools() == ""

    (tmp_path / "Python.h").unlink()
    assert "has no Python.h" in runner.missing_build_tools()
    assert runner.resolve_attention_backend("auto", gpu) == "torch"
