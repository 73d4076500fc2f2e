"""The bench's modes: each one way of serving a workload, ``(workload, setup) -> Run``.

Every mode gets the same token-id prompts, greedy, and a warm-up that is not timed, and returns one
finished RequestOutput per request (with its timestamps) and, when it has them, step reports. What
each mode accepts is checked before anything runs, in :mod:`labkit.serving.bench.checks`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from labkit.core.blocks import blocks_for
from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.request import SamplingParams
from labkit.core.sim import SimulatedModel
from labkit.serving.metrics import Run
from labkit.serving.online import run_workload
from labkit.serving.workloads import WorkloadRequest

WARMUP_PROMPTS = [[3, 4, 5, 6], [4, 5, 6]]
WARMUP_TOKENS = 4
VLLM_GPU_MEMORY_FRACTION = 0.4  # vLLM's share of the GPU, leaving room for the other modes in the same process


@dataclass
class BenchSetup:
    """What every mode of one bench shares: the model, its tokenizer (None for token-id models), the engine knobs.

    ``static_batch_size`` is the batch of the static modes, ``labkit-static`` and ``hf-generate`` (default
    ``config.max_num_seqs``, which caps the continuous modes); ``progress`` is called with the number of
    requests that just finished, so a progress bar can follow a run.
    """

    model: Any
    tokenizer: Any
    config: EngineConfig
    ignore_eos: bool = True
    model_name: str = ""
    static_batch_size: int | None = None
    progress: Callable[[int], None] | None = None

    @property
    def simulated(self) -> bool:
        return isinstance(self.model, SimulatedModel)

    @property
    def batch_size(self) -> int:
        """Requests per static batch."""
        return self.static_batch_size or self.config.max_num_seqs

    def finished(self, count: int) -> None:
        if self.progress is not None:
            self.progress(count)


ModeFn = Callable[[Sequence[WorkloadRequest], BenchSetup], Run]


# ---------------------------------------------------------------------------------------------- labkit
def labkit_config(setup: BenchSetup, policy: str) -> EngineConfig:
    """The engine configuration of a labkit mode: the static policy batches ``setup.batch_size`` requests.

    Prefix caching and async scheduling are continuous-batching features: the static baseline runs without them.
    """
    batch: dict[str, Any] = {}
    if policy == "static":
        batch = {"max_num_seqs": setup.batch_size, "enable_prefix_caching": False, "async_scheduling": False}
    return replace(setup.config, policy=policy, **batch)


def run_labkit(workload: Sequence[WorkloadRequest], setup: BenchSetup, policy: str) -> Run:
    """Serve the workload on a fresh labkit Engine with the given batching policy."""
    engine = Engine(setup.model, labkit_config(setup, policy))
    if not setup.simulated:  # first steps on a real model pay one-off costs (allocation, kernel choice)
        engine.generate(WARMUP_PROMPTS, SamplingParams(max_new_tokens=WARMUP_TOKENS, ignore_eos=True))
    engine.step_listeners.append(lambda report: setup.finished(len(report.finished)))
    return run_workload(engine, workload, ignore_eos=setup.ignore_eos)


def labkit_continuous(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """labkit's engine with continuous batching (and chunked prefill unless the config turns it off)."""
    return run_labkit(workload, setup, "continuous")


def labkit_static(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """labkit's engine with static batching: a new batch only when the previous one is fully done."""
    return run_labkit(workload, setup, "static")


# ---------------------------------------------------------------------------------------------- transformers
def hf_generate(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """transformers ``generate`` on left-padded batches of the static batch size, in arrival order."""
    from labkit.serving.baselines import timed_padded_generate

    batch_size = setup.batch_size
    pad = pad_token_id(setup.model)
    timed_padded_generate(setup.model, WARMUP_PROMPTS, [WARMUP_TOKENS] * 2, batch_size, pad)
    outputs = timed_padded_generate(
        setup.model,
        [r.prompt for r in workload],
        [r.max_new_tokens for r in workload],
        batch_size,
        pad,
        arrival_times=[r.arrival_time for r in workload],
        eos_token_ids=eos_ids(setup),
        on_finish=setup.finished,
    )
    return Run(outputs, [])


def hf_continuous(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """transformers' continuous batching with labkit's block size, token budget, max_num_seqs and cache size."""
    from labkit.serving.baselines import TransformersContinuous

    cfg = setup.config
    with TransformersContinuous(
        setup.model,
        block_size=cfg.block_size,
        num_blocks=baseline_num_blocks(setup),
        max_batch_tokens=cfg.max_batch_tokens,
        max_num_seqs=cfg.max_num_seqs,
    ) as manager:
        manager.serve(WARMUP_PROMPTS, [WARMUP_TOKENS] * 2)
        outputs = manager.serve(
            [r.prompt for r in workload],
            [r.max_new_tokens for r in workload],
            arrival_times=[r.arrival_time for r in workload],
            eos_token_ids=eos_ids(setup),
            on_finish=setup.finished,
        )
    return Run(outputs, [])


def pad_token_id(model: Any) -> int:
    """The model's padding id, as labkit's runner picks it: 0 where the config has none, or one outside the
    vocabulary (some hold -1)."""
    pad = model.config.get_text_config().pad_token_id
    vocab = model.get_input_embeddings().num_embeddings
    return pad if isinstance(pad, int) and 0 <= pad < vocab else 0


def eos_ids(setup: BenchSetup) -> frozenset[int]:
    """The EOS ids a baseline stops at: none unless ``--respect-eos`` (labkit's engine reads the same ones)."""
    if setup.ignore_eos:
        return frozenset()
    eos = getattr(setup.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = setup.model.config.get_text_config().eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def baseline_num_blocks(setup: BenchSetup) -> int | None:
    """Baselines get the cache labkit's runner would size on the CPU; on a GPU both size from free memory."""
    from labkit.runtime.runner import cpu_cache_blocks, resolve_device

    cfg = setup.config
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    return cpu_cache_blocks(setup.model, cfg.block_size) if resolve_device(cfg.device).type == "cpu" else None


# ---------------------------------------------------------------------------------------------- vLLM
def vllm_offline(workload: Sequence[WorkloadRequest], setup: BenchSetup) -> Run:
    """vLLM's engine on the same model (loaded by vLLM from its directory or hub id), all requests at once."""
    from labkit.serving.baselines import vllm_serve

    cfg = setup.config
    dtype = str(next(setup.model.parameters()).dtype).removeprefix("torch.")
    llm = _vllm_llm(
        vllm_model_path(setup.model_name),
        dtype,
        vllm_cache_bytes(setup),
        cfg.block_size,
        cfg.max_num_seqs,
        cfg.max_batch_tokens,
        vllm_max_model_len(workload, cfg.block_size, max_model_len(setup.model)),
    )
    vllm_serve(llm, WARMUP_PROMPTS, [WARMUP_TOKENS] * 2)
    prompts, wanted = [r.prompt for r in workload], [r.max_new_tokens for r in workload]
    outputs = vllm_serve(llm, prompts, wanted, ignore_eos=setup.ignore_eos, on_finish=setup.finished)
    return Run(outputs, [])


def vllm_model_path(spec: str) -> str:
    """What vLLM loads for a ``--model`` spec: it takes a directory or hub id, not labkit's in-memory models."""
    from labkit.models import BUNDLED_DIR, SMOLLM2_HUB_ID

    if spec == "tiny-shakespeare":
        return str(BUNDLED_DIR)
    if spec == "smollm2-135m":
        return SMOLLM2_HUB_ID
    if spec.partition(":")[0] in ("sim", "random"):
        raise ValueError(f"mode 'vllm' loads its model from a directory or hub id; --model {spec} is neither")
    return spec


def vllm_max_model_len(workload: Sequence[WorkloadRequest], block_size: int, model_len: int) -> int:
    """The context vLLM is started with: what the workload's longest request needs, in whole blocks.

    vLLM refuses to start unless its KV cache holds one request of ``max_model_len`` tokens, and by
    default that is the model's whole context (8192 tokens for SmolLM2), more than labkit's cache budget
    may hold. The workload needs far less.
    """
    longest = max(len(r.prompt) + r.max_new_tokens for r in workload)
    return min(blocks_for(longest, block_size) * block_size, model_len)


def vllm_cache_bytes(setup: BenchSetup) -> int | None:
    """vLLM's KV-cache size on a CPU: labkit's cache (vLLM would take a share of the machine's RAM).

    On a GPU, None: vLLM sizes its cache from its share of GPU memory, as labkit's runner does.
    """
    from labkit.runtime.runner import cpu_cache_blocks, kv_bytes_per_block

    if not vllm_on_cpu():
        return None
    cfg = setup.config
    num_blocks = cfg.num_blocks or cpu_cache_blocks(setup.model, cfg.block_size)
    return num_blocks * kv_bytes_per_block(setup.model, cfg.block_size)


@lru_cache(maxsize=1)  # one vLLM engine per process: it holds a fixed share of the GPU
def _vllm_llm(
    path: str,
    dtype: str,
    cache_bytes: int | None,
    block_size: int,
    max_num_seqs: int,
    max_batch_tokens: int,
    max_model_len: int,
) -> Any:
    from labkit.serving.baselines import import_vllm

    cache = {} if cache_bytes is None else {"kv_cache_memory_bytes": cache_bytes}
    return import_vllm().LLM(
        model=path,
        dtype=dtype,  # the dtype the other modes run in, not the one in the model's config
        skip_tokenizer_init=True,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_batch_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        gpu_memory_utilization=VLLM_GPU_MEMORY_FRACTION,
        seed=0,
        **cache,
    )


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM is a CPU build: its device comes from the build, not from ``--device``."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def max_model_len(model: Any) -> int:
    """The longest sequence (prompt + output) the model takes."""
    if isinstance(model, SimulatedModel):
        return model.max_model_len
    return model.config.get_text_config().max_position_embeddings


def release_gpu_cache() -> None:
    """Give cached GPU memory back after a run, so the next mode (or vLLM) sizes its cache from a clean slate."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


MODES: dict[str, ModeFn] = {
    "labkit-continuous": labkit_continuous,
    "labkit-static": labkit_static,
    "hf-generate": hf_generate,
    "hf-continuous": hf_continuous,
    "vllm": vllm_offline,
}
