"""Engine configuration: the knobs an inference server exposes, in one plain dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.core.request import as_bool, as_int

POLICIES = ("continuous", "static")
SCHEDULING = ("fcfs", "priority", "shortest-first")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
DEFAULT_MAX_NUM_SEQS = 64


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches requests and how big its KV cache is.

    ``max_batch_tokens`` is the per-step token budget shared by prefill chunks and decode tokens
    (vLLM's ``max_num_batched_tokens``); ``max_num_seqs`` caps how many requests run at once. Every
    running request needs a token of the budget, so ``max_num_seqs`` may not exceed ``max_batch_tokens``:
    left unset (None) it becomes ``min(64, max_batch_tokens)``; a value you set is checked.
    ``num_blocks=None`` lets the runner size the cache from memory: on CUDA 90% of what is free after
    the weights and a warm-up step, on CPU a fixed 256 MiB (never most of RAM). ``device="auto"`` is
    CUDA when present, else CPU; ``dtype=None`` keeps the model's dtype. ``pack_weights`` lets a CPU
    runner keep a second copy of the linear weights in oneDNN's layout, which makes the linear layers
    1.3-1.9x faster on some CPUs and slower on others (see labkit.runtime.packed): None (the default) times
    both once per model and keeps the faster, True and False choose; it has no effect on CUDA.

    ``enable_prefix_caching`` lets requests share the cached blocks of a common prompt prefix
    (labkit.core.prefix_cache; continuous policy only). ``scheduling`` orders the waiting queue
    (labkit.core.queues): ``"fcfs"`` by arrival, ``"priority"`` by ``SamplingParams.priority`` (and a
    waiting request may preempt a running one it outranks), ``"shortest-first"`` by expected tokens
    with ageing.

    ``attention_backend`` picks the paged attention: ``"torch"`` (plain torch, the reference),
    ``"triton"`` (one fused kernel per layer, labkit.runtime.triton_attention) or ``"auto"`` (Triton on
    CUDA when it is installed, torch otherwise). ``use_cuda_graph`` replays decode-only steps as CUDA
    graphs (labkit.runtime.cuda_graphs); None means on wherever the Triton backend runs on CUDA and the model's
    forward can be captured (not with a RoPE that decides on the host: labkit.runtime.runner.graph_blocker).

    ``async_scheduling`` plans and launches step N+1 before step N's sampled tokens are back on the host,
    so on a GPU the host's Python work overlaps the GPU's (continuous policy only). Every running request
    is assumed to go on; one that step N stops (EOS, a stop token) has its row in step N+1 computed and
    thrown away. Tokens are the same as without it; each step's report comes one ``step()`` later.

    A config is frozen, so what an engine was built with is what it runs: change a field with
    ``dataclasses.replace(config, field=value)``, which checks the new config again. Its integers and flags may
    be numpy's, as sizes worked out with numpy often are; they are stored as Python ints and bools.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int = 512
    max_num_seqs: int | None = None  # None: min(DEFAULT_MAX_NUM_SEQS, max_batch_tokens)
    policy: str = "continuous"
    chunked_prefill: bool = True
    device: str = "auto"
    dtype: Any = None
    pack_weights: bool | None = None  # None: packed where measured faster
    enable_prefix_caching: bool = False
    scheduling: str = "fcfs"
    attention_backend: str = "auto"
    use_cuda_graph: bool | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "max_batch_tokens"):
            self._set(name, _positive_int(name, getattr(self, name)))
        if self.max_num_seqs is None:
            self._set("max_num_seqs", min(DEFAULT_MAX_NUM_SEQS, self.max_batch_tokens))
        self._set("max_num_seqs", _positive_int("max_num_seqs", self.max_num_seqs))
        if self.num_blocks is not None:
            self._set("num_blocks", _positive_int("num_blocks", self.num_blocks))
        if self.max_num_seqs > self.max_batch_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must be <= max_batch_tokens ({self.max_batch_tokens}):"
                " every running request needs at least one token of the step's budget (dataclasses.replace"
                " keeps the max_num_seqs a config had, even one derived from its old budget: set both)"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.scheduling not in SCHEDULING:
            raise ValueError(f"scheduling must be one of {SCHEDULING}, got {self.scheduling!r}")
        for name in ("chunked_prefill", "enable_prefix_caching", "async_scheduling"):
            self._set(name, as_bool(name, getattr(self, name)))
        self._set("pack_weights", as_bool("pack_weights", self.pack_weights, none_ok=True))
        if self.enable_prefix_caching and self.policy == "static":
            raise ValueError(
                "enable_prefix_caching needs policy='continuous': the static baseline prefills whole padded prompts"
            )
        if self.async_scheduling and self.policy == "static":
            raise ValueError(
                "async_scheduling needs policy='continuous': a static batch's rows are fixed, there is nothing to plan"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        self._set("use_cuda_graph", as_bool("use_cuda_graph", self.use_cuda_graph, none_ok=True))

    def _set(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # the dataclass is frozen; only __post_init__ normalizes


def _positive_int(name: str, value: object) -> int:
    """An integer >= 1 of any kind (numpy's included) as a Python int; bool is refused."""
    value = as_int(name, value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value
