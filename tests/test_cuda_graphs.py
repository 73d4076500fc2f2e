"""CUDA graphs for decode steps give the same tokens as eager steps (skipped without CUDA).

What a graph bakes in must not leak into its results: bucket padding (batch sizes between buckets),
preemption (requests leave and come back recomputed), and contexts longer than any seen at capture
(the graphs are captured with empty contexts, then replayed as contexts grow to hundreds of tokens).

One check runs without a GPU too: the forward pass a graph records must not wait for the device or
build tensors from host data, which capture forbids. On a CPU it is watched op by op as it runs.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit import Engine, EngineConfig, SamplingParams
from labkit.models.random import random_model

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
# Ops that read a value back to the host (a sync), make a tensor from Python data (a host-to-device copy
# from pageable memory), or whose output shape depends on the data: each one breaks a CUDA graph capture.
CAPTURE_BREAKERS = {
    "aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal", "aten.lift_fresh", "aten.nonzero",
    "aten.masked_select", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim", "aten.repeat_interleave",
}  # fmt: skip


def run(model: torch.nn.Module, prompts: list[list[int]], wanted: list[int], **options: object) -> tuple[Engine, list]:
    # A cache of a fixed size: sized from a large GPU's free memory it would take the kernel's 64-bit offsets.
    config = EngineConfig(device="cuda", attention_backend="triton", **{"num_blocks": 1024, **options})
    engine = Engine(model, config)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    return engine, [o.output_token_ids for o in engine.generate(prompts, params)]


def workload(n: int, prompt_len: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return random_model("qwen2", "tiny", seed=1).to("cuda")


@needs_cuda
def test_graph_on_by_default_on_cuda(model: torch.nn.Module) -> None:
    engine, _ = run(model, workload(1, (4, 4)), [3], max_num_seqs=4)
    assert engine.runner.use_cuda_graph and engine.runner.graphs.num_replays == 2


@needs_cuda
def test_same_tokens_across_bucket_boundaries(model: torch.nn.Module) -> None:
    """Requests finish one after another, so the decode batch walks down through 19..1 (buckets 24, 16, 8, 4, 2, 1)."""
    prompts = workload(19, (5, 60))
    wanted = [4 + 3 * i for i in range(19)]
    engine, graphed = run(model, prompts, wanted, max_num_seqs=24)
    _, eager = run(model, prompts, wanted, max_num_seqs=24, use_cuda_graph=False)
    assert engine.runner.graphs.num_replays > 50
    assert graphed == eager


@needs_cuda
def test_same_tokens_after_preemption(model: torch.nn.Module) -> None:
    prompts = workload(12, (20, 80), seed=2)
    wanted = [60] * 12
    options = dict(max_num_seqs=12, num_blocks=40, block_size=16)
    _, graphed = run(model, prompts, wanted, **options)
    preempted: list[int] = []
    config = EngineConfig(device="cuda", attention_backend="triton", use_cuda_graph=False, **options)
    eager_engine = Engine(model, config)
    eager_engine.step_listeners.append(lambda report: preempted.extend(report.preempted))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    eager = [o.output_token_ids for o in eager_engine.generate(prompts, params)]
    assert preempted, "the workload was meant to preempt"
    assert graphed == eager


@needs_cuda
def test_contexts_longer_than_at_capture(model: torch.nn.Module) -> None:
    """One engine, graphs captured once: short contexts first, then contexts of 700+ tokens (44+ blocks)."""
    options = dict(device="cuda", attention_backend="triton", max_num_seqs=8, num_blocks=1024)
    engine = Engine(model, EngineConfig(**options))
    eager = Engine(model, EngineConfig(use_cuda_graph=False, **options))
    for prompt_len, new in (((4, 8), 8), ((600, 700), 120)):
        prompts = workload(6, prompt_len, seed=prompt_len[0])
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        graphed = [o.output_token_ids for o in engine.generate(prompts, params)]
        assert graphed == [o.output_token_ids for o in eager.generate(prompts, params)]


@needs_cuda
def test_a_graphed_step_whose_prompt_chunk_samples_nothing_does_not_wait_for_the_gpu(model: torch.nn.Module) -> None:
    """A budget of 4 tokens: three decodes and a long prompt fed one token a step, whose row samples nothing. The
    graph's logits are then picked by the header's sampling rows, already on the device; an index made from a
    Python list would be copied from pageable memory, which waits for the GPU (the sync debug mode raises)."""
    options = dict(max_num_seqs=4, max_batch_tokens=4, block_size=8, num_blocks=1024)
    prompts, wanted = [[5, 6, 7], [8, 9, 10], [11, 12, 13], workload(1, (40, 40))[0]], [40, 40, 40, 4]
    engine = Engine(model, EngineConfig(device="cuda", attention_backend="triton", **options))
    graphs, replay = engine.runner.graphs, engine.runner.graphs.run
    watched: list[int] = []

    def strict(output: Any, *args: Any) -> Any:
        if any(not chunk.samples for chunk in output.chunks):
            watched.append(output.step)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return replay(output, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    graphs.run = strict
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    graphed = [o.output_token_ids for o in engine.generate(prompts, params)]
    _, eager = run(model, prompts, wanted, use_cuda_graph=False, **options)
    assert len(watched) >= 30  # 37 such steps on a CPU, under Triton's interpreter
    assert graphed == eager


@needs_cuda
def test_a_dropped_engine_leaves_the_next_one_as_large_a_cache(model: torch.nn.Module) -> None:
    """An engine with graphs is a reference cycle (runner and graphs), so dropping it frees nothing until Python
    collects cycles; an engine that sizes its cache from free memory collects first, or it would get a tenth."""
    config = EngineConfig(device="cuda", attention_backend="triton", max_num_seqs=4)
    first = Engine(model, config).allocator.num_blocks  # the engine is dropped at once, its cache still held
    second = Engine(model, config).allocator.num_blocks
    assert second >= 0.9 * first, (first, second)


class OpRecorder(TorchDispatchMode):
    """Counts every aten op that runs inside it (the ops themselves run as usual)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_captured_forward_neither_syncs_nor_copies_from_the_host(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replayed decode step's forward, watched: no op from CAPTURE_BREAKERS (on CUDA: no sync at all)."""
    cuda = torch.cuda.is_available()
    if not cuda:
        from labkit.runtime.runner import interpreter_runs_kernels

        if os.environ.get("TRITON_INTERPRET") != "1" or not interpreter_runs_kernels():
            pytest.skip("without CUDA this needs Triton's interpreter (TRITON_INTERPRET=1, triton>=3.7)")
        pytest.importorskip("triton")
    device = "cuda" if cuda else "cpu"
    model = random_model(arch, "tiny", seed=0).to(device)
    config = EngineConfig(
        device=device, attention_backend="triton", use_cuda_graph=True, block_size=8, num_blocks=32, max_num_seqs=2
    )
    engine = Engine(model, config)
    graphs = engine.runner.graphs
    recorder, forward = OpRecorder(), graphs.forward

    def watched(*args: Any) -> torch.Tensor:
        if cuda:  # the real thing: any synchronising call raises
            torch.cuda.set_sync_debug_mode("error")
        try:
            with recorder:
                return forward(*args)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(graphs, "forward", watched)
    if cuda:  # replays do not call the forward: capture again, watched, into a pool of their own
        # (a pool whose graphs are all gone, while their outputs live, cannot take new captures)
        graphs.graphs.clear()
        graphs.outputs.clear()
        graphs.pool = torch.cuda.graph_pool_handle()
        for size in reversed(graphs.buckets):
            graphs._capture(size)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine.generate([[5, 6, 7], [8] * 11], params)
    assert graphs.num_replays >= 5
    assert recorder.ops["aten.embedding"] > 0, "the watched forward never ran"
    assert not CAPTURE_BREAKERS & set(recorder.ops), sorted(CAPTURE_BREAKERS & set(recorder.ops))


def test_graphs_inputs_are_aligned_and_the_cache_leaves_room_for_their_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each bucket's graph keeps its own logits (rows x vocabulary): 1.3 GB for Qwen2.5-0.5B at 256 sequences,
    enough to fail the capture on a 15 GB T4 whose cache took 90% of what was free. The runner leaves them aside:
    what the graphs hold (on a CPU, under the interpreter, their warm-up outputs) is what it reserved."""
    from labkit.runtime import runner as runner_module
    from labkit.runtime.cuda_graphs import logits_bytes

    if os.environ.get("TRITON_INTERPRET") != "1" or not runner_module.interpreter_runs_kernels():
        pytest.skip("without CUDA this needs Triton's interpreter (TRITON_INTERPRET=1, triton>=3.7)")
    pytest.importorskip("triton")
    model = random_model("llama", "tiny", seed=0)
    config = EngineConfig(attention_backend="triton", use_cuda_graph=True, block_size=8, num_blocks=16, max_num_seqs=10)
    runner = Engine(model, config).runner
    held = sum(output.nbytes for output in runner.graphs.outputs.values())  # buckets 1, 2, 4, 8, 10
    assert held == logits_bytes(10, runner.vocab_size, runner.dtype) == 25 * runner.vocab_size * 4
    # A graph's inputs start on 16 bytes at any max_num_seqs, as an eager step's do: Triton compiles a kernel
    # anew for a pointer that does not, so every kernel would be built twice.
    input_ids, batch = runner.graphs._inputs(8)
    inputs = (input_ids, batch.position_ids, batch.slot_mapping, batch.seq_lens, batch.block_tables)
    assert all(tensor.data_ptr() % 16 == 0 for tensor in inputs), [tensor.data_ptr() % 16 for tensor in inputs]

    # Sizing the cache as on a GPU with 1 GB free and no other memory needed, graphs on and off.
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(runner, "_warm_up", lambda block_size: 0)
    monkeypatch.setattr(runner_module.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(runner_module.torch.cuda, "mem_get_info", lambda device: (2**30, 2**31))
    per_block = runner_module.kv_bytes_per_block(model, 8)
    with_graphs = runner._blocks_from_memory(8)
    monkeypatch.setattr(runner, "use_cuda_graph", False)
    without = runner._blocks_from_memory(8)
    fraction = runner_module.CUDA_MEMORY_FRACTION
    assert with_graphs == int(fraction * (2**30 - held)) // per_block
    assert without == int(fraction * 2**30) // per_block
