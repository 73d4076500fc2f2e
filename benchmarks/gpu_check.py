"""One run that checks labkit's GPU path and measures it: correctness, throughput, decode against the memory floor.

1. Correctness - labkit greedy against transformers ``generate`` (float32: token for token; bfloat16: the next
   token after each prefix of generate's output, see BF16_POLICY), and the Triton kernel against the torch path.
2. Throughput - labkit continuous, labkit static and transformers' continuous batching (the engine behind
   ``generate_batch``, with the best attention it has here) on the nano-vllm benchmark (256 requests, prompt
   and output lengths uniform in 100..1024, random-weight Qwen2.5-0.5B shape, bfloat16, EOS ignored), then on
   a ShareGPT-like workload. Output tokens per second of wall time, as nano-vllm counts them.
3. Decode step time at batch 1, 8, 64 and 256 (800-token contexts) against the memory-bandwidth floor:
   (weight bytes + KV bytes read per step) / the copy bandwidth measured in this run. CUDA graphs on and off;
   with graphs on, also the GPU's share alone (the step's graph replayed, no host work around it).
   The attention kernel alone at that batch, for each key-tile size and warp count, against the same floor.
4. Utilisation - NVML's GPU utilisation, and model-bandwidth utilisation (bytes a step must read, over the
   time it took, over the measured bandwidth; and over NVML's peak bandwidth, as MBU is usually quoted), labkit
   static against continuous.
5. Traces - a continuous and a static run of one workload, recorded with NVML samples on every StepReport,
   to labkit/data/traces/gpu_{continuous,static}.json (the course's GPU notebook replays them).
6. Profile - where a decode step's time goes at the largest batch: host time by engine phase (graphs on),
   and device time by kernel (torch.profiler, graphs off so that every kernel shows).

Everything goes to one JSON file (``--out``), rewritten after each part, so a run cut short keeps what it
measured; a short table is printed last. ``--device cpu --quick`` runs the
same script end to end on a CPU in well under a minute (tiny model, few requests, the kernel through Triton's
interpreter), which is how CI keeps it working. Exit status 1 if a correctness check fails.

Run: ``python benchmarks/gpu_check.py [--device cuda] [--quick] [--budget SECONDS] [--out gpu_check.json]
[--traces DIR]``.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import importlib.util
import itertools
import json
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on a CPU only through the interpreter

import torch
from rich.console import Console
from rich.table import Table
from torch.autograd import DeviceType

from labkit import Engine, EngineConfig, SamplingParams, StepReport
from labkit.core.blocks import blocks_for
from labkit.models.random import random_model
from labkit.runtime.runner import device_name, interpreter_runs_kernels, kv_bytes_per_block
from labkit.serving.baselines import TimeLimitReached, TransformersContinuous, padded_generate
from labkit.serving.metrics import GpuMonitor, _nvml_handle, frozen_heap
from labkit.serving.workloads import WorkloadRequest, make_workload

TRACE_DIR = Path(__file__).resolve().parent.parent / "labkit" / "data" / "traces"
HAS_TRITON = importlib.util.find_spec("triton") is not None
#: Teacher-forced next-token agreement that bfloat16 must reach (see BF16_POLICY).
BF16_AGREEMENT = 0.95
BF16_POLICY = (
    "bfloat16 rounds differently from float32 (and transformers batches its matmuls differently), so free-running"
    " greedy outputs part at the first near-tie and differ from there on. So the check is teacher-forced: given"
    " each prefix of generate's output, labkit's greedy next token must equal generate's at no fewer than"
    f" {BF16_AGREEMENT:.0%} of the positions; the free-running first divergence is reported beside it"
)
TARGETS = {"continuous_vs_hf": 3.0, "nano_tokens_per_s": 17_700, "decode_256_floor_ratio": 2.0}
ASYNC = "labkit continuous, async scheduling"  # step N+1 planned and launched while step N runs
#: How long transformers' run may go on past --budget (scripts/gpu_run.sh kills the script 90 s after it).
OVERRUN_S = 45.0


class Settings:
    """Sizes of one run: the full GPU check, or the quick CPU one."""

    def __init__(self, device: torch.device, quick: bool) -> None:
        self.device = device
        self.quick = quick
        if quick:
            self.model = dict(arch="llama", size="tiny")
            self.dtype = torch.float32
            self.num_requests, self.lengths, self.sharegpt_max = 8, (16, 48), 48
            self.decode_batches, self.decode_context, self.decode_steps = (1, 4), 64, 3
            self.trace_requests, self.trace_max = 6, 32
            self.parity_tokens, self.max_num_seqs, self.static_batch = 12, 8, 4
            self.num_blocks, self.max_batch_tokens = 512, 256
            self.hf_time_limit = None
        else:
            self.model = dict(arch="qwen2", size="qwen2.5-0.5b")
            self.dtype = torch.bfloat16
            self.num_requests, self.lengths, self.sharegpt_max = 256, (100, 1024), 1024
            self.decode_batches, self.decode_context, self.decode_steps = (1, 8, 64, 256), 800, 20
            self.trace_requests, self.trace_max = 48, 512
            self.parity_tokens, self.max_num_seqs, self.static_batch = 32, 256, 64
            self.num_blocks, self.max_batch_tokens = 40_000, 16_384  # 640K tokens of KV: the whole benchmark
            # transformers' run may take minutes where labkit's takes seconds: past this, its rate so far counts.
            self.hf_time_limit = 60.0


# ---------------------------------------------------------------------------------------------- helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give a finished part's memory back: an engine and its CUDA graphs reference each other (a cycle)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def engine_config(settings: Settings, policy: str = "continuous", **overrides: Any) -> EngineConfig:
    static = policy == "static"
    options: dict[str, Any] = dict(
        device=settings.device.type,
        block_size=16,
        num_blocks=settings.num_blocks,
        # A static batch prefills its padded prompts in one step.
        max_batch_tokens=settings.static_batch * settings.lengths[1] if static else settings.max_batch_tokens,
        max_num_seqs=settings.static_batch if static else settings.max_num_seqs,
        policy=policy,
    )
    options.update(overrides)
    return EngineConfig(**options)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads for the weights (tied embeddings once: the LM head reads the whole matrix)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    return kv_bytes_per_block(model, 1)


def step_bytes(report: StepReport, weights: int, per_token: int) -> int:
    """What a step must read at least: every weight once and the KV cache of every row's context."""
    rows = report.scheduled + report.padding
    return weights + per_token * sum(w.start + w.num_tokens for w in rows)


def measure_bandwidth(device: torch.device, quick: bool) -> float:
    """Bytes per second of one big device-to-device copy (read + write), best of a few."""
    size = (64 if quick else 2048) * 2**20
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del source, target
    release(device)
    return 2 * size / best


def peak_bandwidth(device: torch.device) -> float | None:
    """The memory's peak bytes per second as NVML describes it: two transfers a clock x its top memory clock x
    its bus width (an H100 SXM: 2 x 2,619 MHz x 640 bytes = 3.35 TB/s, its datasheet's figure). MBU is usually
    quoted against this peak; a copy reaches less of it. None without NVML."""
    handle = _nvml_handle(device.index or 0) if device.type == "cuda" else None
    if handle is None:
        return None
    try:
        import pynvml

        clock_hz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM) * 1e6
        bus_bytes = pynvml.nvmlDeviceGetMemoryBusWidth(handle) / 8
    except Exception:  # an NVML too old for the bus width, or a device that does not report it
        return None
    return 2 * clock_hz * bus_bytes or None


def requests_of(workload: list[WorkloadRequest]) -> tuple[list[list[int]], list[int]]:
    return [list(w.prompt) for w in workload], [w.max_new_tokens for w in workload]


class Parts:
    """The check's parts, run in order: each one's results go under its name in one JSON file.

    An error in a part is recorded, not raised, and the run goes on. The file is rewritten after every
    part (a run stopped by a time limit keeps the parts it finished), and a part that would start after
    ``budget_s`` seconds is skipped, so that the summary table is still printed inside an outer time limit.
    """

    def __init__(self, results: dict[str, Any], console: Console, out: Path, budget_s: float | None) -> None:
        self.results, self.console, self.out = results, console, out
        self.deadline = time.perf_counter() + budget_s if budget_s is not None else float("inf")

    def seconds_left(self) -> float:
        """Seconds until the budget is spent (negative once it is)."""
        return self.deadline - time.perf_counter()

    def run(self, name: str, body: Callable[[dict[str, Any]], Any]) -> Any:
        """``body(part)`` fills ``part``; returns what it returns (None when skipped or failed)."""
        part: dict[str, Any] = {}
        self.results[name] = part
        if time.perf_counter() > self.deadline:
            part["skipped"] = "the time budget (--budget) was spent"
            self.console.print(f"[bold]{name}[/bold]: skipped, the time budget was spent")
            save(self.results, self.out)
            return None
        start = time.perf_counter()
        self.console.print(f"[bold]{name}[/bold] ...")
        value = None
        try:
            value = body(part)
        except Exception as error:  # one failing part must not lose the others' numbers
            part["error"] = f"{type(error).__name__}: {error}"
            part["traceback"] = traceback.format_exc()
            self.console.print(f"  [red]{part['error']}[/red]")
        part["seconds"] = round(time.perf_counter() - start, 2)
        self.console.print(f"  done in {part['seconds']} s")
        save(self.results, self.out)
        return value


def save(results: dict[str, Any], out: Path) -> None:
    """Write the JSON whole or not at all: a time limit's kill mid-write leaves the previous file."""
    unfinished = out.with_name(out.name + ".partial")
    unfinished.write_text(json.dumps(results, indent=2, default=str))
    os.replace(unfinished, out)


class NvmlSampler:
    """A step listener that writes NVML's current GPU utilisation into each StepReport (``gpu_util``)."""

    def __init__(self, device: torch.device, min_interval: float = 0.02) -> None:
        self.handle = _nvml_handle(device.index or 0) if device.type == "cuda" else None
        self.min_interval = min_interval
        self.last_time = 0.0
        self.last_value: float | None = None

    def __call__(self, report: StepReport) -> None:
        if self.handle is None:
            return
        now = time.perf_counter()
        if now - self.last_time >= self.min_interval:  # NVML averages over ~1/6 s anyway
            import pynvml

            self.last_value = float(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            self.last_time = now
        report.gpu_util = self.last_value


# ---------------------------------------------------------------------------------------------- 1. correctness
def check_parity(settings: Settings, part: dict[str, Any]) -> bool:
    """labkit greedy vs transformers generate on a few prompts, float32 then bfloat16."""
    rng = random.Random(0)
    model = random_model("qwen2", "tiny", seed=3).to(settings.device)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    wanted = [settings.parity_tokens] * len(prompts)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16 on a CPU too: CI runs this path
        model = model.to(dtype)
        expected = padded_generate(model, prompts, wanted, batch_size=1)
        engine = Engine(model, engine_config(settings, max_num_seqs=4, num_blocks=64, max_batch_tokens=256))
        got = [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=wanted[0]))]
        divergence = [next((i for i, (a, b) in enumerate(zip(e, g, strict=True)) if a != b), len(e))
                      for e, g in zip(expected, got, strict=True)]  # fmt: skip
        name = str(dtype).removeprefix("torch.")
        entry = {
            "first_divergence": divergence,
            "tokens": settings.parity_tokens,
            "backend": engine.runner.attention_backend,
        }
        if dtype == torch.float32:
            entry["passed"] = got == expected
        else:
            entry["policy"] = BF16_POLICY
            entry["agreement"] = teacher_forced_agreement(engine, prompts, expected)
            entry["passed"] = entry["agreement"] >= BF16_AGREEMENT
        part[name] = entry
        ok &= entry["passed"] or dtype != torch.float32  # bf16 is reported, float32 must hold
        del engine
    return ok


def teacher_forced_agreement(engine: Engine, prompts: list[list[int]], expected: list[list[int]]) -> float:
    """The share of positions where labkit, given a prompt and the first ``i`` tokens that generate produced,
    picks generate's token ``i`` next. Each position is a request of its own, so one near-tie costs one position,
    not every position after it as in a free run."""
    pairs = zip(prompts, expected, strict=True)
    prefixes = [prompt + tokens[:i] for prompt, tokens in pairs for i in range(len(tokens))]
    wanted = [token for tokens in expected for token in tokens]
    picked = [o.output_token_ids[0] for o in engine.generate(prefixes, SamplingParams(max_new_tokens=1))]
    return sum(a == b for a, b in zip(picked, wanted, strict=True)) / len(wanted)


def check_kernel(settings: Settings, part: dict[str, Any]) -> bool:
    """The Triton kernel against the torch path on random steps (GQA 1/4/7/8, head dims 64/128): a mixed step,
    and a decode step of three requests, which a GPU splits into parts (triton_attention.decode_splits)."""
    if not HAS_TRITON:
        part["skipped"] = "triton is not installed"
        return True
    if settings.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        part["skipped"] = "on a CPU the kernel runs only under TRITON_INTERPRET=1 (pass --device cpu)"
        return True
    if settings.device.type == "cpu" and not interpreter_runs_kernels():
        part["skipped"] = "this triton's interpreter cannot run the kernels (needs triton>=3.7)"
        return True
    from labkit.runtime.attention import PagedKVCache, Segment, build_paged_batch, paged_attention_forward
    from labkit.runtime.triton_attention import StepUploader, build_triton_batch, triton_attention_forward

    layer = type("Layer", (), {"layer_idx": 0})()
    device = settings.device
    shapes = [(4, 64, 16, torch.float32), (7, 64, 16, torch.bfloat16)]
    if not settings.quick:
        shapes += [(1, 128, 32, torch.float16), (8, 128, 16, torch.bfloat16), (4, 64, 32, torch.float32)]
    # |error| <= atol + rtol * |reference|: a low-precision output is rounded relative to its own size.
    tolerance = {torch.float32: (1e-4, 0.0), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 2e-2)}
    rng = random.Random(1)
    ok = True
    longest = 40 if settings.quick else 900
    for (group, head_dim, block_size, dtype), kind in itertools.product(shapes, ("mixed", "3 decodes")):
        if kind == "mixed":
            specs = [(0, rng.randint(2, longest // 2)), (rng.randint(1, longest), 1), (rng.randint(1, longest), 7)]
            specs += [(rng.randint(1, longest), 1) for _ in range(3 if settings.quick else 60)]
        else:
            specs = [(rng.randint(1, longest), 1) for _ in range(3)]
        num_kv = 2
        num_blocks = sum(blocks_for(c + n, block_size) for c, n in specs) + 1
        free = list(range(num_blocks))
        rng.shuffle(free)
        segments = [Segment(c, n, [free.pop() for _ in range(blocks_for(c + n, block_size))]) for c, n in specs]
        tokens = sum(n for _, n in specs)
        reference = PagedKVCache(1, num_blocks, block_size, num_kv, head_dim, torch.float32, device)
        cache = PagedKVCache(1, num_blocks, block_size, num_kv, head_dim, dtype, device)
        cache.data.normal_()
        reference.data.copy_(cache.data.float())
        q = torch.randn(1, num_kv * group, tokens, head_dim, device=device).to(dtype)
        k = torch.randn(1, num_kv, tokens, head_dim, device=device).to(dtype)
        v = torch.randn(1, num_kv, tokens, head_dim, device=device).to(dtype)
        batch = build_paged_batch(reference, segments, device)
        expected, _ = paged_attention_forward(layer, q.float(), k.float(), v.float(), None, paged_batch=batch)
        _, triton_batch, _ = build_triton_batch(cache, segments, [0] * tokens, [], StepUploader(device))
        got, _ = triton_attention_forward(layer, q, k, v, None, paged_batch=triton_batch)
        difference = (got.float() - expected).abs()
        atol, rtol = tolerance[dtype]
        passed = bool((difference <= atol + rtol * expected.abs()).all())
        ok &= passed
        name = f"{kind}: group {group}, head_dim {head_dim}, block {block_size}, {str(dtype).removeprefix('torch.')}"
        part[name] = {
            "max_abs_error": float(difference.max()),
            "tolerance": f"{atol:g} + {rtol:g} x |reference|",
            "tokens": tokens,
            "passed": passed,
        }
    return ok


# ---------------------------------------------------------------------------------------------- 2. throughput
def run_labkit(
    model: torch.nn.Module, settings: Settings, workload: list[WorkloadRequest], policy: str, **options: Any
) -> dict:
    prompts, wanted = requests_of(workload)
    engine = Engine(model, engine_config(settings, policy, **options))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted]
    engine.generate(prompts[:4], [SamplingParams(max_new_tokens=4, ignore_eos=True)] * 4)  # warm-up
    reports: list[StepReport] = []
    engine.step_listeners.append(reports.append)
    with GpuMonitor() as gpu, frozen_heap():
        sync(settings.device)
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
    if [len(o.output_token_ids) for o in outputs] != wanted:
        raise RuntimeError(f"labkit {policy} did not generate the requested number of tokens")
    weights, per_token = weight_bytes(model), kv_bytes_per_token(model)
    # A step's time is the gap since the previous step ended: with async scheduling each report spans the
    # launch to the token read, so durations overlap, while the gaps add up to the wall time.
    gaps = [r.end_time - before.end_time for before, r in itertools.pairwise(reports)]
    decode_steps = [(r, gap) for r, gap in zip(reports[1:], gaps, strict=True) if r.num_prefill_tokens == 0]
    result = {
        "wall_s": wall,
        "output_tokens": sum(wanted),
        "tokens_per_s": sum(wanted) / wall,
        "steps": len(reports),
        "bytes_read": sum(step_bytes(r, weights, per_token) for r in reports),
        "decode_bytes_per_s": sum(step_bytes(r, weights, per_token) for r, _ in decode_steps)
        / max(sum(gap for _, gap in decode_steps), 1e-9),
        "gpu_util_percent": gpu.utilization,
        "peak_memory_bytes": gpu.peak_memory_bytes,
        "attention_backend": engine.runner.attention_backend,
        "cuda_graphs": engine.runner.use_cuda_graph,
        "async_scheduling": engine.config.async_scheduling,
        "graph_steps": engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0,
    }
    del engine
    release(settings.device)
    return result


# transformers' paged|sdpa builds a dense (query x key) mask per step: its token budget stays modest. The table and
# the JSON say so next to its rate, which therefore compares engines as each runs best, not at equal settings.
HF_MAX_BATCH_TOKENS = 2048


def best_hf_attention() -> str:
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "sdpa"


def run_transformers(
    model: torch.nn.Module, settings: Settings, workload: list[WorkloadRequest], time_limit: float | None
) -> dict:
    prompts, wanted = requests_of(workload)
    attention = best_hf_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        with TransformersContinuous(
            model,
            block_size=16,
            num_blocks=settings.num_blocks,
            max_batch_tokens=min(HF_MAX_BATCH_TOKENS, settings.max_batch_tokens),
            max_num_seqs=settings.max_num_seqs,
        ) as hf:
            hf.generate(prompts[:4], [4] * 4)  # warm-up
            stopped = None
            with GpuMonitor() as gpu, frozen_heap():
                start = time.perf_counter()
                try:
                    outputs = hf.generate(prompts, wanted, time_limit=time_limit)
                    wall, tokens = time.perf_counter() - start, sum(wanted)
                    if [len(o) for o in outputs] != wanted:
                        raise RuntimeError("transformers did not generate the requested number of tokens")
                except TimeLimitReached as limit:  # its rate over the time it had, marked as such
                    stopped, wall, tokens = str(limit), limit.seconds, limit.tokens
    finally:
        model.set_attn_implementation(previous)
    release(settings.device)
    result = {
        "wall_s": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "attention": f"paged|{attention}",
        "max_batch_tokens": min(HF_MAX_BATCH_TOKENS, settings.max_batch_tokens),
        "gpu_util_percent": gpu.utilization,
        "peak_memory_bytes": gpu.peak_memory_bytes,
    }
    return result | ({"partial": stopped} if stopped else {})


def throughput(
    model: torch.nn.Module,
    settings: Settings,
    workload: list[WorkloadRequest],
    part: dict,
    checkpoint: Callable[[], None] = lambda: None,
    seconds_left: Callable[[], float] = lambda: float("inf"),
) -> None:
    """Each method on the same workload; ``checkpoint`` saves the results after each (a baseline may stall).

    transformers runs for at most ``settings.hf_time_limit`` seconds, and until OVERRUN_S past the budget
    (``seconds_left``) but at least 10 s; a method that would start more than OVERRUN_S past it is skipped. So
    this part ends before an outer time limit (90 s after the budget in scripts/gpu_run.sh) even when it starts
    last and late.
    """

    def hf_time_limit() -> float | None:
        limit = min(settings.hf_time_limit or float("inf"), max(10.0, seconds_left() + OVERRUN_S))
        return None if limit == float("inf") else limit

    runs: dict[str, Callable[[], dict]] = {
        "labkit continuous": lambda: run_labkit(model, settings, workload, "continuous"),
        ASYNC: lambda: run_labkit(model, settings, workload, "continuous", async_scheduling=True),
        "labkit static": lambda: run_labkit(model, settings, workload, "static"),
        "transformers generate_batch": lambda: run_transformers(model, settings, workload, hf_time_limit()),
    }
    prompts, wanted = requests_of(workload)
    part["workload"] = {
        "requests": len(workload),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": sum(wanted),
    }
    for name, run in runs.items():
        if seconds_left() < -OVERRUN_S:  # the runs before it took this part past what the outer limit allows
            part[name] = {"skipped": f"it would start more than {OVERRUN_S:.0f} s past the time budget"}
            checkpoint()
            continue
        try:
            part[name] = run()
        except Exception as error:  # e.g. the baseline failing on this machine: keep labkit's numbers
            part[name] = {"error": f"{type(error).__name__}: {error}"}
        checkpoint()


# ---------------------------------------------------------------------------------------------- 3. decode floor
def decode_floor(model: torch.nn.Module, settings: Settings, bandwidth: float, part: dict) -> None:
    """Mean decode step time with every request at ``decode_context`` tokens, against the bandwidth floor."""
    weights, per_token = weight_bytes(model), kv_bytes_per_token(model)
    rng = random.Random(2)
    vocab = model.config.vocab_size
    # (CUDA graphs, async scheduling): on a CPU, graphs need the Triton interpreter, far too slow to time.
    modes = [(False, False), (True, False), (True, True)] if settings.device.type == "cuda" and HAS_TRITON else []
    for graphs, ahead in modes or [(False, False), (False, True)]:
        config = engine_config(
            settings, max_num_seqs=max(settings.decode_batches), use_cuda_graph=graphs, async_scheduling=ahead
        )
        engine = Engine(model, config)
        for batch in settings.decode_batches:
            params = SamplingParams(max_new_tokens=settings.decode_steps + 8, ignore_eos=True)
            ids = [
                engine.add_request([rng.randrange(3, vocab) for _ in range(settings.decode_context)], params)
                for _ in range(batch)
            ]
            while True:  # prefill everything, then one untimed decode step
                report = engine.step()
                if report.num_prefill_tokens == 0:
                    break
            times, contexts = [], []
            for _ in range(settings.decode_steps):
                start = time.perf_counter()
                report = engine.step()  # ends by reading the sampled tokens: the step is done
                times.append(time.perf_counter() - start)
                contexts.append(sum(w.start + 1 for w in report.scheduled))
            step = statistics.median(times)
            floor = (weights + per_token * statistics.mean(contexts)) / bandwidth
            name = f"batch {batch}, graphs {'on' if graphs else 'off'}{', async scheduling' if ahead else ''}"
            entry = part[name] = {
                "step_ms": step * 1e3,
                "floor_ms": floor * 1e3,
                "x_floor": step / floor,
                "tokens_per_s": batch / step,
            }
            if engine.runner.attention_backend == "triton" and settings.device.type == "cuda":
                from labkit.runtime.triton_attention import decode_splits, sm_count

                kv_heads = engine.runner.num_kv_heads
                entry["attention_splits"] = decode_splits(batch * kv_heads, sm_count(settings.device))
            if graphs:  # the GPU's share of the step: its graph replayed alone, on the last step's inputs
                device_step = replay_seconds(engine.runner.graphs, batch, settings.device)
                entry |= {"device_ms": device_step * 1e3, "device_x_floor": device_step / floor}
            for request_id in ids:
                engine.abort(request_id)
            while engine.has_unfinished():  # reports the aborts (and, async, finishes the steps launched ahead)
                engine.step()
        del engine
        release(settings.device)


def replay_seconds(graphs: Any, batch: int, device: torch.device) -> float:
    """Device seconds of one decode step with no host work around it: its bucket's graph, replayed.

    The static buffers still hold the last step's inputs, so a replay recomputes that step (and stores
    the same keys and values again). The difference to the step's time is the host's share.
    """
    size = graphs.buckets[bisect.bisect_left(graphs.buckets, batch)]
    return _time_kernel(graphs.graphs[size].replay, 10, device)


def kernel_shapes(model: torch.nn.Module, settings: Settings, bandwidth: float, part: dict) -> None:
    """The decode attention kernel alone, batch x context as in the decode-floor part, for each (tile, warps).

    On CUDA the keys and values come from memory, not from the L2 cache (see _time_kernel).
    """
    from labkit.runtime.attention import PagedKVCache
    from labkit.runtime.triton_attention import launch_shape, paged_attention

    if not HAS_TRITON:
        part["skipped"] = "triton is not installed"
        return
    if settings.device.type == "cpu" and (os.environ.get("TRITON_INTERPRET") != "1" or not interpreter_runs_kernels()):
        part["skipped"] = "on a CPU the kernel runs only under a recent Triton's interpreter"
        return
    device, dtype = settings.device, settings.dtype
    text = model.config.get_text_config()
    num_heads, num_kv_heads = text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    batch, context, block_size = max(settings.decode_batches), settings.decode_context, 16
    blocks_per_seq = blocks_for(context, block_size)
    cache = PagedKVCache(1, batch * blocks_per_seq, block_size, num_kv_heads, head_dim, dtype, device)
    key_cache, value_cache = cache.parts[0]
    cache.data.normal_()
    tables = torch.randperm(batch * blocks_per_seq, device=device).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, device=device).to(dtype)
    out = torch.empty_like(query)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * cache.data.element_size()
    default = launch_shape(max(16, 1 << (head_dim - 1).bit_length()))
    shapes = [default] if settings.quick else [(t, w) for t in (16, 32, 64) for w in (2, 4, 8)]
    launches = 1 if settings.quick else 40
    for tile, warps in shapes:
        name = f"tile {tile}, warps {warps}"
        try:
            launch = partial(
                paged_attention, query, key_cache, value_cache, query_start_loc, seq_lens, tables, head_dim**-0.5,
                max_query_len=1, out=out, tile=tile, num_warps=warps,
            )  # fmt: skip
            seconds = _time_kernel(launch, launches, device)
        except Exception as error:  # a shape the compiler rejects on this GPU: keep the others
            part[name] = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
            continue
        part[name] = {
            "us": seconds * 1e6,
            "kv_bytes": kv_bytes,
            "of_bandwidth": kv_bytes / seconds / bandwidth,
            "default": (tile, warps) == default,
        }
    part["shape"] = {"batch": batch, "context": context, "heads": num_heads, "kv_heads": num_kv_heads,
                     "head_dim": head_dim, "block_size": block_size}  # fmt: skip
    del cache, key_cache, value_cache
    release(device)


def _time_kernel(launch: Callable[[], Any], launches: int, device: torch.device) -> float:
    """Seconds per call of ``launch``, after one untimed call (the compile).

    On CUDA, Triton's do_bench times each launch with events behind an L2 flush: the keys and values come
    from memory, and the flush keeps the GPU busy while the host issues the launch (a kernel of tens of
    microseconds is shorter than its launch).
    """
    launch()
    sync(device)
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(launch, warmup=5, rep=40) / 1e3
    start = time.perf_counter()
    for _ in range(launches):
        launch()
    return (time.perf_counter() - start) / launches


def profile_decode(model: torch.nn.Module, settings: Settings, part: dict) -> None:
    """Where a decode step's time goes at the largest decode batch, contexts as in the decode-floor part.

    Host: mean milliseconds per step in the scheduler's plan, the runner (inputs, launches, and the wait for
    the sampled tokens) and the commit, with CUDA graphs on. Device: torch.profiler's time per kernel over
    a few steps with graphs off (a graph's kernels would show as one replay).
    """
    from torch.profiler import ProfilerActivity, profile

    batch, steps = max(settings.decode_batches), settings.decode_steps
    rng = random.Random(3)
    vocab = model.config.vocab_size
    for graphs in [True, False] if settings.device.type == "cuda" and HAS_TRITON else [False]:
        engine = Engine(model, engine_config(settings, max_num_seqs=batch, use_cuda_graph=graphs))
        params = SamplingParams(max_new_tokens=2 * steps + 8, ignore_eos=True)
        for _ in range(batch):
            engine.add_request([rng.randrange(3, vocab) for _ in range(settings.decode_context)], params)
        while engine.step().num_prefill_tokens:  # prefill everything, then one untimed decode step
            pass
        if graphs:
            phases = {"plan": (engine.scheduler, "schedule"), "run": (engine.runner, "execute"),
                      "commit": (engine.scheduler, "update")}  # fmt: skip
            spent = dict.fromkeys(phases, 0.0)
            for name, (owner, method) in phases.items():
                setattr(owner, method, _timed(getattr(owner, method), spent, name))
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            total = (time.perf_counter() - start) / steps
            host = {name: seconds / steps * 1e3 for name, seconds in spent.items()}
            part["host_ms_per_step"] = {**host, "other": total * 1e3 - sum(host.values()), "step": total * 1e3}
        else:
            activities = [ProfilerActivity.CPU]
            if settings.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            with profile(activities=activities) as profiler:
                for _ in range(steps):
                    engine.step()
                sync(settings.device)
            part["kernels"] = top_kernels(profiler, settings.device, steps)
        del engine
        release(settings.device)


def _timed(function: Callable[..., Any], spent: dict[str, float], name: str) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return timed


KERNEL_KINDS = {  # substrings of kernel names, first match wins
    "attention": ("paged_attention", "store_kv", "merge_splits"),
    "matmul": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "addmm", "linear", "matmul"),
    "sampling": ("argmax", "argmin", "sort", "topk", "softmax"),
    "elementwise": ("elementwise", "vectorized", "reduce", "mul", "add", "pow", "rsqrt", "silu", "cat", "copy"),
}


def top_kernels(profiler: Any, device: torch.device, steps: int, top: int = 12) -> dict[str, Any]:
    """Device time per step by kernel (the ``top`` largest) and by kind; on a CPU, self time per op instead."""
    rows = []
    for event in profiler.key_averages():
        if device.type == "cuda":
            # Only kernels: a host op (aten::mm) reports its kernels' time as its own device time too.
            if event.device_type != DeviceType.CUDA or event.is_user_annotation:
                continue
            seconds = event.self_device_time_total
        else:
            seconds = event.self_cpu_time_total
        rows.append((event.key, seconds / 1e3 / steps, event.count // steps))  # microseconds -> ms per step
    rows.sort(key=lambda row: -row[1])
    total = sum(ms for _, ms, _ in rows)
    kinds: dict[str, float] = {}
    for name, ms, _ in rows:
        lowered = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS.items() if any(key in lowered for key in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    return {
        "ms_per_step": total,
        "launches_per_step": sum(count for *_, count in rows),
        "by_kind_ms": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        "top": [{"name": name[:120], "ms": ms, "calls": count} for name, ms, count in rows[:top]],
    }


# ---------------------------------------------------------------------------------------------- 5. traces
def record_traces(model: torch.nn.Module, settings: Settings, directory: Path, bandwidth: float, part: dict) -> None:
    """A continuous and a static trace of one workload, with NVML samples and what a roofline needs (notebook 08)."""
    from labkit.core.trace import record

    workload = make_workload(
        "sharegpt-like", settings.trace_requests, seed=5, vocab_size=model.config.vocab_size, special_ids=(0, 1, 2),
        max_len=settings.trace_max,
    )  # fmt: skip
    prompts, wanted = requests_of(workload)
    directory.mkdir(parents=True, exist_ok=True)
    for policy in ("continuous", "static"):
        engine = Engine(model, engine_config(settings, policy, max_num_seqs=min(32, settings.max_num_seqs)))
        engine.step_listeners.append(NvmlSampler(settings.device))
        recorder = record(engine)
        with frozen_heap():  # a collection's stall would show in the trace as one very slow step
            engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in wanted])
        recorder.meta["model"] = f"random-weight {settings.model['size']} ({settings.model['arch']}), {settings.dtype}"
        recorder.meta.update(
            weight_bytes=weight_bytes(model), kv_bytes_per_token=kv_bytes_per_token(model), bandwidth=bandwidth
        )
        path = recorder.save(directory / f"gpu_{policy}.json")
        samples = [r.gpu_util for r in recorder.reports if r.gpu_util is not None]
        part[policy] = {
            "path": str(path),
            "bytes": path.stat().st_size,
            "steps": len(recorder.reports),
            "gpu_util_samples": len(samples),
            "mean_gpu_util": statistics.mean(samples) if samples else None,
        }
        del engine
        release(settings.device)


# ---------------------------------------------------------------------------------------------- main
def summary_table(results: dict[str, Any], bandwidth: float) -> tuple[Table, list[str]]:
    table = Table(title="gpu_check summary")
    for column in ("what", "value", "target"):
        table.add_column(column, justify="left" if column == "what" else "right")
    notes: list[str] = []
    correctness = results.get("correctness", {})
    for name in ("float32", "bfloat16"):
        entry = correctness.get("parity", {}).get(name)
        if entry:
            value = f"first divergence {entry['first_divergence']}"
            if "agreement" in entry:
                value = f"{entry['agreement']:.0%} of next tokens teacher-forced; {value}"
            table.add_row(f"parity {name}", value, "pass" if entry["passed"] else "FAIL")
    kernel = correctness.get("kernel", {})
    errors = [v["max_abs_error"] for v in kernel.values() if isinstance(v, dict) and "max_abs_error" in v]
    if errors:
        passed = all(v["passed"] for v in kernel.values() if isinstance(v, dict) and "passed" in v)
        table.add_row("Triton kernel vs torch (max error)", f"{max(errors):.2e}", "pass" if passed else "FAIL")
    measured = results.get("bandwidth", {})
    peak = measured.get("peak_bytes_per_s")
    if "bytes_per_s" in measured:
        value = f"{measured['bytes_per_s'] / 1e9:,.0f} GB/s"
        if peak:
            value += f" ({measured['bytes_per_s'] / peak:.0%} of NVML's peak, {peak / 1e9:,.0f} GB/s)"
        table.add_row("memory bandwidth, device copy (the floors' bandwidth)", value, "")
    for workload in ("nano-vllm", "sharegpt-like"):
        part = results.get(f"throughput {workload}", {})
        rates = {k: v.get("tokens_per_s") for k, v in part.items() if isinstance(v, dict) and "tokens_per_s" in v}
        continuous = [name for name in rates if name.startswith("labkit continuous")]
        best = max(continuous, key=lambda name: rates[name], default=None)  # the targets hold for the best
        for name, rate in rates.items():
            target = ""
            if workload == "nano-vllm" and name == best:
                target = f">= {TARGETS['nano_tokens_per_s']:,}"
            cut = f" (first {part[name]['wall_s']:.0f} s)" if "partial" in part[name] else ""
            table.add_row(f"{workload}: {name} tok/s{cut}", f"{rate:,.0f}", target)
        for name in (*continuous, "labkit static"):
            entry = part.get(name, {})
            if "decode_bytes_per_s" in entry:
                value = f"{entry['decode_bytes_per_s'] / bandwidth:.0%}"
                if peak:
                    value += f" ({entry['decode_bytes_per_s'] / peak:.0%} of the peak)"
                table.add_row(f"{workload}: {name} MBU (decode, of the copy's bandwidth)", value, "")
        hf = rates.get("transformers generate_batch")
        if hf and best is not None:
            ratio, entry = rates[best] / hf, part["transformers generate_batch"]
            cut = f" (its first {entry['wall_s']:.0f} s)" if "partial" in entry else ""
            target = f">= {TARGETS['continuous_vs_hf']}x"
            table.add_row(f"{workload}: {best} / transformers{cut}", f"{ratio:.2f}x", target)
            if "max_batch_tokens" in entry:
                table.add_row(f"{workload}: transformers' token budget", f"{entry['max_batch_tokens']:,}", "")
    for name, entry in results.get("decode floor", {}).items():
        if isinstance(entry, dict) and "x_floor" in entry:
            target = f"<= {TARGETS['decode_256_floor_ratio']}x" if name.startswith("batch 256") else ""
            parts = f", attention in {entry['attention_splits']} parts" if entry.get("attention_splits", 1) > 1 else ""
            step = f"{entry['step_ms']:.2f} ({entry['x_floor']:.2f}x)"
            table.add_row(f"decode {name}{parts}: ms (x floor)", step, target)
            if "device_ms" in entry:
                device = f"{entry['device_ms']:.2f} ({entry['device_x_floor']:.2f}x)"
                table.add_row("  of which the GPU alone (graph replay): ms (x floor)", device, "")
    shapes = {k: v for k, v in results.get("kernel shapes", {}).items() if isinstance(v, dict) and "us" in v}
    if shapes:
        default = next((k for k, v in shapes.items() if v["default"]), None)
        best = min(shapes, key=lambda k: shapes[k]["us"])
        for name in dict.fromkeys([default, best]):
            if name is not None:
                label = "default" if name == default else "fastest"
                entry = shapes[name]
                table.add_row(f"decode attention alone, {label} ({name})",
                              f"{entry['us']:.0f} us ({entry['of_bandwidth']:.0%} of bw)", "")  # fmt: skip
    profile = results.get("profile", {})
    host = profile.get("host_ms_per_step")
    if host:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in host.items() if k != "step")
        table.add_row("decode step, graphs on: ms by phase", f"{host['step']:.2f} ({phases})", "")
    kernels = profile.get("kernels")
    if kernels:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in kernels["by_kind_ms"].items())
        table.add_row(
            "decode step, graphs off: device ms by kind",
            f"{kernels['ms_per_step']:.2f} in {kernels['launches_per_step']} launches ({kinds})",
            "",
        )
    for name, part in results.items():
        if isinstance(part, dict) and "error" in part:
            notes.append(f"[red]error[/red] {name}: {part['error']}")
        elif isinstance(part, dict) and "skipped" in part:
            notes.append(f"[yellow]skipped[/yellow] {name}: {part['skipped']}")
    return table, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny model and workloads (the CPU check in CI)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="where the JSON results go")
    parser.add_argument(
        "--traces",
        type=Path,
        default=None,
        help="trace directory (default: labkit/data/traces on CUDA, next to --out otherwise)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds after which no further part starts (the table is still printed); default: no limit",
    )
    args = parser.parse_args()

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    settings = Settings(device, args.quick)
    traces = args.traces or (TRACE_DIR if device.type == "cuda" else args.out.parent)
    console = Console(width=120)
    if device.type == "cpu":
        # One thread, as every script here: transformers' batching manager steps on a thread of its own, and
        # intra-op threads fighting it for a small machine's cores made its rate swing threefold between runs.
        torch.set_num_threads(1)
    results: dict[str, Any] = {
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": importlib.import_module("transformers").__version__,
        "triton": importlib.import_module("triton").__version__ if HAS_TRITON else None,
        "quick": args.quick,
        "targets": TARGETS,
    }
    console.print(f"gpu_check on {results['device']}: torch {results['torch']}, triton {results['triton']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    parts = Parts(results, console, args.out, args.budget)

    def correctness(part: dict[str, Any]) -> bool:
        part["parity"], part["kernel"] = {}, {}
        try:
            parity = check_parity(settings, part["parity"])
        finally:  # the kernel's check runs even if the parity check crashed
            kernel = check_kernel(settings, part["kernel"])
        return parity and kernel

    ok = parts.run("correctness", correctness) is True  # None: the check crashed, which fails it

    def bandwidths(part: dict[str, Any]) -> float:
        part["peak_bytes_per_s"] = peak_bandwidth(device)
        return part.setdefault("bytes_per_s", measure_bandwidth(device, args.quick))

    bandwidth = parts.run("bandwidth", bandwidths)
    bandwidth = float("nan") if bandwidth is None else bandwidth

    def build(part: dict[str, Any]) -> torch.nn.Module:
        model = random_model(settings.model["arch"], settings.model["size"], seed=0, dtype=settings.dtype)
        part.update(settings.model, dtype=str(settings.dtype), weight_bytes=weight_bytes(model),
                    kv_bytes_per_token=kv_bytes_per_token(model))  # fmt: skip
        return model.to(device)

    model = parts.run("model", build)
    if model is None:  # nothing else can run: say so in the table
        finish(results, bandwidth, console, args.out, ok=False)
    vocab, special = model.config.vocab_size, (0, 1, 2)
    workloads = {
        "nano-vllm": make_workload(
            "uniform", settings.num_requests, seed=0, vocab_size=vocab, special_ids=special,
            prompt_len=settings.lengths, output_len=settings.lengths,
        ),
        "sharegpt-like": make_workload(
            "sharegpt-like", settings.num_requests, seed=1, vocab_size=vocab, special_ids=special,
            max_len=settings.sharegpt_max,
        ),
    }  # fmt: skip
    checkpoint = partial(save, results, args.out)
    # Most telling first: should a time limit stop the run, what it lost is the least needed.
    left = parts.seconds_left
    parts.run(
        "throughput nano-vllm",
        lambda part: throughput(model, settings, workloads["nano-vllm"], part, checkpoint, left),
    )
    parts.run("decode floor", lambda part: decode_floor(model, settings, bandwidth, part))
    parts.run("traces", lambda part: record_traces(model, settings, traces, bandwidth, part))
    parts.run("kernel shapes", lambda part: kernel_shapes(model, settings, bandwidth, part))
    parts.run(
        "throughput sharegpt-like",
        lambda part: throughput(model, settings, workloads["sharegpt-like"], part, checkpoint, left),
    )
    # Last: CUDA's profiling interface (CUPTI) has crashed processes that capture CUDA graphs after it ran; should
    # it, every other part is measured and saved by then.
    parts.run("profile", lambda part: profile_decode(model, settings, part))
    finish(results, bandwidth, console, args.out, ok)


def finish(results: dict[str, Any], bandwidth: float, console: Console, out: Path, ok: bool) -> None:
    """Print the notes and the summary table last; exit 1 if a check failed."""
    table, notes = summary_table(results, bandwidth)
    for note in notes:
        console.print(note)
    console.print(f"results: {out}")
    console.print(table)
    if not ok:
        console.print("[red]a correctness check failed, or the model could not be built[/red]")
        sys.exit(1)


if __name__ == "__main__":
    main()
