"""The torch side of the engine: run a transformers causal LM on one packed step over a paged KV cache.

Each step the scheduler hands over chunks (runs of tokens of one request). The runner concatenates them
into a single row with no padding, gives every token its true position, runs the model once, and
projects only the rows that produce a token through the LM head. Keys and values go to the blocks the
allocator chose; attention reads them back from there (labkit.runtime.attention).

Threads: the runner never changes torch's thread settings; it uses whatever ``torch.set_num_threads``
the caller chose (benchmarks pin it to 1).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sysconfig
import time
import weakref
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from packaging.version import Version

from labkit.core.blocks import BlockAllocator, blocks_for
from labkit.core.config import EngineConfig
from labkit.core.request import PENDING_TOKEN, Request
from labkit.core.scheduler import SchedulerOutput
from labkit.runtime.attention import (
    ATTENTION_NAME,
    AttentionFn,
    PagedKVCache,
    Segment,
    SlotMappingFn,
    build_paged_batch,
    long_tensor,
    slot_mapping,
    use_paged_attention,
)
from labkit.runtime.packed import PackedLinears
from labkit.runtime.sampling import Sampler, checked_samples, feed_back_samples

# num_blocks=None on CPU: a fixed KV-cache budget, small next to any machine's RAM.
CPU_CACHE_BYTES = 256 * 2**20
# num_blocks=None on CUDA: this fraction of the memory left free after the weights and a warm-up step.
CUDA_MEMORY_FRACTION = 0.9
# Triton compiles labkit's kernels from 3.6 on; its CPU interpreter runs them from 3.7 on (3.6's cannot bound
# a loop by a value the kernel loaded from memory).
MIN_TRITON = (3, 6)
INTERPRETER_MIN_TRITON = (3, 7)
# The oldest NVIDIA GPUs labkit's kernels are built for: compute capability 7.5 (a T4).
MIN_TRITON_CAPABILITY = (7, 5)
INSTALL_TRITON = "pip install 'labkit-batching[gpu]'"  # the extra that brings triton, named where it is missing
WARM_UP_TOKENS = 64  # a small prefill when the engine starts on a GPU: Triton compiles the prefill kernel then

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The live runners of each model: a second runner may convert a model only while no other one uses it.
_RUNNERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakSet[ModelRunner]] = weakref.WeakKeyDictionary()


class LaunchedStep(NamedTuple):
    """A step the runner has queued on the device: ``collect`` reads its tokens once ``ready`` has fired."""

    samples: torch.Tensor  # one token per sampling chunk, on the device
    host: torch.Tensor  # the same tokens on the host (page-locked on CUDA), valid once ``ready`` has fired
    ready: torch.cuda.Event | None  # recorded after the copy to ``host`` (None on a CPU: done already)
    requests: list[Request]  # whose token each row is
    ready_at: float | None  # on a CPU, when launch computed the tokens; on CUDA None (read as they arrive)


class ModelRunner:
    """Owns a transformers model and its paged KV cache, and turns a SchedulerOutput into sampled tokens.

    The model is moved to the configured device and dtype in place (``nn.Module.to``) and put in eval mode; a
    model whose forward its paged steps would compute otherwise is refused first (:func:`attention_it_lacks`),
    with the model left as it was. While another live runner uses the model, a runner that would convert it to
    another device or dtype is refused: the other runner's cache and packed weights were made for the old one.
    Its attention is switched to labkit's paged attention only while a step runs, so ``model.generate`` still
    works; on a CPU its linear layers likewise run on oneDNN-packed weights during a step (labkit.runtime.packed).

    Three parts can be swapped, which is how the exercises run inside the engine: ``slot_mapping_fn``
    (signature of :func:`labkit.runtime.attention.slot_mapping`), ``attention_fn`` (signature of
    :func:`labkit.runtime.attention.paged_attention`, called per request and layer instead of the batched
    fast path; both need the torch attention backend) and ``sampler`` (a :class:`Sampler`, or a callable with
    its signature). A plugged-in sampler's tokens are checked in the step that drew them (at one wait for the
    device), so that a bad one fails that step, which the engine rolls back, instead of a later one.
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        *,
        slot_mapping_fn: SlotMappingFn | None = None,
        attention_fn: AttentionFn | None = None,
        sampler: Any = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        output_embeddings = getattr(model, "get_output_embeddings", None)
        if output_embeddings is None or output_embeddings() is None:
            raise TypeError(
                f"{type(model).__name__} has no LM head: a base model computes hidden states, not next-token"
                " logits. Load a causal LM (transformers' AutoModelForCausalLM, or labkit.models.load)"
            )
        self.config = config
        self.device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype)
        # Every check comes before the model is converted: a refused engine leaves the model as it was.
        _check_conversion(model, self.device, dtype)
        for name, part in (("slot_mapping_fn", slot_mapping_fn), ("attention_fn", attention_fn), ("sampler", sampler)):
            if part is not None and not callable(part):
                raise TypeError(f"{name} must be callable, got {type(part).__name__}")
        missing = attention_it_lacks(model)
        if missing:
            raise ValueError(
                f"{type(model).__name__} cannot run in labkit's paged steps: {missing}, so its tokens would be wrong."
                " Use transformers' generate for this model"
            )
        if attention_fn is not None and uses_sliding_window(model):
            raise ValueError("an attention_fn attends to the whole context; this model uses a sliding window")
        backend = config.attention_backend
        if slot_mapping_fn is not None or attention_fn is not None:  # they plug into the torch attention
            if backend == "triton":
                raise ValueError("slot_mapping_fn and attention_fn need attention_backend='torch' (or 'auto')")
            backend = "torch"
        self.attention_backend = resolve_attention_backend(backend, self.device)
        self.use_cuda_graph = resolve_use_cuda_graph(config.use_cuda_graph, self.attention_backend, self.device, model)
        first = next(model.parameters())
        if first.is_meta:
            raise ValueError(f"{type(model).__name__}'s weights are on the 'meta' device: it was never loaded")
        text = model.config.get_text_config()
        if not isinstance(getattr(text, "max_position_embeddings", None), int):
            raise ValueError(f"{type(model).__name__}'s config has no max_position_embeddings: its length is unknown")
        self.max_model_len = model_length(text)
        self.num_layers, self.num_kv_heads, self.head_dim = kv_layout(model)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = _eos_token_ids(model)
        pad = getattr(text, "pad_token_id", None)  # fills the rows thrown away; some configs hold -1, or nothing
        self.pad_token_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self._model_was = (first.device, first.dtype)  # put back if the cache cannot be allocated
        self.model = model.to(device=self.device, dtype=dtype).eval()  # the one change to the model, after every read
        self.dtype = next(model.parameters()).dtype
        self.device_name = device_name(self.device)
        self.slot_mapping_fn = slot_mapping if slot_mapping_fn is None else slot_mapping_fn
        self.attention_fn = attention_fn
        self.sampler = Sampler() if sampler is None else sampler
        self.cache: PagedKVCache | None = None
        self.attention_name = ATTENTION_NAME
        self.graphs: Any = None  # DecodeGraphs, captured in init_cache
        try:  # packing copies the weights (and times them), which may fail: then no runner, and the model as it was
            if config.pack_weights is None:  # packed where this CPU runs packed weights faster (runtime.packed)
                self.packed_linears = PackedLinears.if_faster(self.model)
            else:
                self.packed_linears = PackedLinears.of(self.model) if config.pack_weights else None
            if self.attention_backend == "triton":
                from labkit.runtime.triton_attention import TRITON_ATTENTION_NAME, StepUploader

                self.attention_name = TRITON_ATTENTION_NAME
                self.uploader = StepUploader(self.device)
        except BaseException:
            self.model.to(device=self._model_was[0], dtype=self._model_was[1])
            raise

    def discard(self) -> None:
        """Undo ``init_cache`` for an engine that was refused after it: drop the cache and graphs, and put the model
        back on the device and dtype it had (a no-op where another engine uses it, which refuses any change)."""
        self.cache = self.graphs = None
        runners = _RUNNERS.get(self.model)
        if runners is not None:
            runners.discard(self)
        self.model.to(device=self._model_was[0], dtype=self._model_was[1])

    def clock(self) -> float:
        """The engine's time stamps come from its runner: wall time here, simulated time in SimulatedModel."""
        return time.perf_counter()

    def init_cache(self, block_size: int, num_blocks: int | None) -> int:
        """Allocate the KV cache; ``num_blocks=None`` sizes it from memory (CPU_CACHE_BYTES, CUDA_MEMORY_FRACTION)."""
        with self._on_device():
            try:
                if num_blocks is None:
                    num_blocks = self._blocks_from_memory(block_size)  # after a full-size warm-up step
                elif self.device.type == "cuda":
                    self._warm_up(block_size, WARM_UP_TOKENS)  # the kernels compile now, not in the first timed step
                self.cache = self._allocate_cache(num_blocks, block_size)
                if self.use_cuda_graph:
                    from labkit.runtime.cuda_graphs import DecodeGraphs

                    with torch.inference_mode():
                        max_blocks = blocks_for(self.max_model_len, block_size)
                        self.graphs = DecodeGraphs(
                            self._forward, self.cache, self.config.max_num_seqs, max_blocks, self.uploader.table_rows
                        )
            except BaseException:
                self.model.to(device=self._model_was[0], dtype=self._model_was[1])  # no engine, no conversion
                raise
        _RUNNERS.setdefault(self.model, weakref.WeakSet()).add(self)  # from now on it needs the model as it is
        return num_blocks

    def _allocate_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """The KV cache, or a ValueError naming its size when the device cannot hold it (not a bare torch OOM)."""
        try:
            return self._new_cache(num_blocks, block_size)
        except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
            needed = num_blocks * kv_bytes_per_block(self.model, block_size)
            raise ValueError(
                f"a KV cache of {num_blocks:,} blocks of {block_size} slots needs {needed / 2**30:,.1f} GiB on"
                f" {self.device_name}, more than could be allocated: set a smaller num_blocks, or None to size"
                " it from the memory there is"
            ) from error

    def execute(self, output: SchedulerOutput, allocator: BlockAllocator) -> list[int]:
        """Run the model once on the step's packed tokens; return one token per sampling chunk, in order."""
        samples, _ = self._run(output, allocator, None)
        return samples if isinstance(samples, list) else samples.tolist()

    @torch.inference_mode()
    def launch(
        self, output: SchedulerOutput, allocator: BlockAllocator, previous: LaunchedStep | None = None
    ) -> LaunchedStep:
        """Queue the step's forward pass and sampling on the device (async scheduling); ``collect`` reads the tokens.

        An input token PENDING_TOKEN is the token ``previous`` sampled for the same request: it is taken from
        ``previous.samples`` on the device (labkit.runtime.sampling.feed_back_samples).
        """
        samples, requests = self._run(output, allocator, previous)
        if isinstance(samples, list):  # from a plugged-in sampler: back to the device, for the next step's inputs
            samples = long_tensor(samples, self.device)
        if self.device.type != "cuda":
            return LaunchedStep(samples, samples, None, requests, self.clock())
        with self._on_device():
            # Copied out now, queued before the next step, so that reading them does not wait for that step too.
            host = torch.empty(samples.shape, dtype=samples.dtype, pin_memory=True)
            host.copy_(samples, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(samples, host, ready, requests, None)

    def collect(self, launched: LaunchedStep) -> list[int]:
        """Wait for a launched step's tokens to reach the host; return them, one per sampling chunk."""
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.host.tolist()

    def ready_time(self, launched: LaunchedStep) -> float | None:
        """When a CPU step's tokens were computed (in ``launch``); None on CUDA, where ``collect`` waits for them."""
        return launched.ready_at

    @torch.inference_mode()
    def _run(
        self, output: SchedulerOutput, allocator: BlockAllocator, previous: LaunchedStep | None
    ) -> tuple[torch.Tensor | list[int], list[Request]]:
        """Queue one step on the device; return its samples (on the device, or the list a plugged-in sampler
        returned) and whose token each one is."""
        if self.cache is None:
            raise RuntimeError("init_cache must be called before a step runs")
        if self.model.training:  # the engine put it in eval mode; model.train() since would make dropout pick tokens
            raise ValueError(
                "the model is in training mode (model.train()): its dropout would change the tokens;"
                " call model.eval() first"
            )
        tables = allocator.block_tables
        rows_before, samples_before = None, None
        if previous is not None:
            rows_before = {r.request_id: i for i, r in enumerate(previous.requests)}
            samples_before = previous.samples
        with self._on_device():
            if self.graphs is not None and self.graphs.can_run(output):
                logits, sampling_requests = self.graphs.run(output, tables, rows_before, samples_before)
            else:
                logits, sampling_requests = self._eager_logits(output, tables, rows_before, samples_before)
            params = [r.params for r in sampling_requests]
            indices = [len(r.output_token_ids) for r in sampling_requests]
            sampler = self.sampler
            if isinstance(sampler, Sampler) and type(sampler).__call__ is Sampler.__call__:  # tokens stay on device
                samples = sampler.sample(logits, params, indices)
            else:
                samples = sampler(logits, params, indices)
            if type(sampler) is not Sampler:  # plugged in: a bad token fails this step, which is rolled back
                samples = checked_samples(
                    samples, self.vocab_size, self.device, [r.request_id for r in sampling_requests]
                )
            return samples, sampling_requests

    def _eager_logits(
        self,
        output: SchedulerOutput,
        tables: dict[Any, list[int]],
        rows_before: dict[Any, int] | None,
        samples_before: torch.Tensor | None,
    ) -> tuple[torch.Tensor, list[Request]]:
        """Pack the step's chunks into one row and run the model on it; the sampling rows' logits, and whose."""
        token_ids: list[int] = []
        segments = []
        sample_rows, sampling_requests = [], []
        fed_back = None  # the previous step's samples, once an input token stands for one of them
        for chunk in output.chunks:
            request = chunk.request
            token_ids += request.tokens(chunk.start, chunk.start + chunk.num_tokens)
            if rows_before is not None and token_ids[-1] == PENDING_TOKEN:
                token_ids[-1] = -1 - rows_before[request.request_id]
                fed_back = samples_before
            segments.append(Segment(chunk.start, chunk.num_tokens, tables[request.request_id]))
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
                sampling_requests.append(request)
        for chunk in output.padding:  # computed like real rows, written to scratch, thrown away
            token_ids += [self.pad_token_id] * chunk.num_tokens
            segments.append(Segment(chunk.start, chunk.num_tokens, tables[chunk.request.request_id], False))
        return self._logits(self.cache, token_ids, segments, sample_rows, fed_back), sampling_requests

    def _on_device(self) -> Any:
        """Make this runner's GPU the current one: Triton kernels and CUDA graphs run on the current device,
        which is not ``cuda:1`` just because the tensors are there."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    # ------------------------------------------------------------------ helpers
    def _logits(
        self,
        cache: PagedKVCache,
        token_ids: list[int],
        segments: list[Segment],
        sample_rows: list[int],
        fed_back: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (len(sample_rows), vocab) for the packed tokens' rows ``sample_rows``.

        ``fed_back``: the previous step's samples, which token ids ``-1 - i`` stand for (async scheduling).
        """
        if self.attention_backend == "torch":
            batch: Any = build_paged_batch(
                cache, segments, self.device, attention_fn=self.attention_fn, slot_mapping_fn=self.slot_mapping_fn
            )
            input_ids = long_tensor(token_ids, self.device)[None]
            if fed_back is not None:
                feed_back_samples(input_ids, fed_back)
            # 0 keeps every row: a pure decode step samples from all of them, and then needs no index.
            keep: Any = 0 if len(sample_rows) == len(token_ids) else long_tensor(sample_rows, self.device)
            return self._forward(input_ids, batch, keep)
        from labkit.runtime.triton_attention import build_triton_batch

        input_ids, batch, keep = build_triton_batch(cache, segments, token_ids, sample_rows, self.uploader)
        if fed_back is not None:
            feed_back_samples(input_ids, fed_back)
        return self._forward(input_ids, batch, keep)

    def _forward(self, input_ids: torch.Tensor, batch: Any, keep: torch.Tensor | int) -> torch.Tensor:
        """One forward pass over a packed step (1, T) whose layout is ``batch``; logits of the ``keep`` rows."""
        linears = self.packed_linears.active() if self.packed_linears else nullcontext()
        with use_paged_attention(self.model, self.attention_name), linears:
            out = self.model(
                input_ids=input_ids,
                position_ids=batch.position_ids[None],
                paged_batch=batch,
                logits_to_keep=keep,
                use_cache=False,
            )
        return out.logits[0]

    def _new_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        return PagedKVCache(
            self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype, self.device
        )

    def _blocks_from_memory(self, block_size: int) -> int:
        if self.device.type != "cuda":
            return cpu_cache_blocks(self.model, block_size)
        per_block = kv_bytes_per_block(self.model, block_size)
        # A dropped engine with CUDA graphs is a reference cycle (its runner and graphs point at each other):
        # collect it, so that its cache does not count as used and shrink this one to a tenth of the GPU.
        gc.collect()
        torch.cuda.empty_cache()
        activations = self._warm_up(block_size)
        if self.use_cuda_graph:
            from labkit.runtime.cuda_graphs import logits_bytes

            activations += logits_bytes(self.config.max_num_seqs, self.vocab_size, self.dtype)
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = int(CUDA_MEMORY_FRACTION * (free - activations))
        if self.attention_backend == "torch":  # Triton reads the blocks in place
            blocks_per_request = blocks_for(self.max_model_len, block_size)
            return blocks_beside_gather(
                budget, per_block, self.config.max_num_seqs, self.num_layers, blocks_per_request
            )
        return max(1, budget // per_block)

    @torch.inference_mode()
    def _warm_up(self, block_size: int, num_tokens: int | None = None) -> int:
        """Run one step (full-size by default) on a throwaway cache; return the peak memory it needed beyond it."""
        num_tokens = min(num_tokens or self.config.max_batch_tokens, self.config.max_batch_tokens, self.max_model_len)
        num_rows = min(self.config.max_num_seqs, num_tokens)
        num_blocks = blocks_for(num_tokens, block_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        cache = self._new_cache(num_blocks, block_size)
        segments = [Segment(0, num_tokens, list(range(num_blocks)))]
        logits = self._logits(cache, [self.pad_token_id] * num_tokens, segments, list(range(num_rows)))
        logits.softmax(dim=-1).sort(dim=-1)  # the sampler's largest temporaries
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - baseline - cache.data.nbytes
        del cache, logits
        torch.cuda.empty_cache()
        return peak


def kv_layout(model: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a transformers model: what one token adds to its KV cache."""
    text = model.config.get_text_config()
    num_kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, num_kv_heads, head_dim


def uses_sliding_window(model: Any) -> bool:
    """Whether any layer of ``model`` attends to a sliding window of recent keys instead of the whole context."""
    text = model.config.get_text_config()
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:  # models that mix full and sliding layers name each layer's kind
        return "sliding_attention" in layer_types
    return getattr(text, "sliding_window", None) is not None


# Kinds of layer (a config's layer_types) whose whole state is the keys and values labkit's cache holds.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


def attention_it_lacks(model: Any) -> str | None:
    """Why labkit's paged steps would not compute ``model``'s forward as the model does (None: they would), so
    that its tokens would be wrong without an error.

    transformers passes extra attention terms to an attention function as keyword arguments, which labkit's would
    take and ignore; and a model whose layers do not call the attention interface, or keep another state than
    keys and values (convolutions, SSMs), would lose it between steps.
    """
    text = model.config.get_text_config()
    if not getattr(type(model), "_supports_attention_backend", False):
        return (
            "it does not declare transformers' attention interface (_supports_attention_backend), which labkit's"
            " attention plugs into"
        )
    kinds = {*(getattr(text, "layer_types", None) or ()), *(getattr(text, "layers_block_type", None) or ())}
    if other := sorted(kinds - ATTENTION_LAYER_TYPES):
        return f"its layers keep a state other than keys and values ({', '.join(other)})"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "labkit's attention leaves out its logit soft-capping (attn_logit_softcapping, as in Gemma 2)"
    if any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in model.modules()):
        return "labkit's attention leaves out its attention sinks (a learned logit per head, as in gpt-oss)"
    return None


def model_length(text_config: Any) -> int:
    """The longest context labkit serves: the config's, or, with longrope RoPE, the length it was trained at.

    longrope picks its frequencies from the largest position in a forward pass: short ones up to
    ``original_max_position_embeddings``, long ones beyond. A packed step holds many requests, so past that length
    one request's frequencies would depend on the others'; below it they are always the short ones.
    """
    length = text_config.max_position_embeddings
    if "longrope" in rope_types(text_config):
        original = _rope_parameters(text_config).get("original_max_position_embeddings") or getattr(
            text_config, "original_max_position_embeddings", None
        )
        if isinstance(original, int):
            length = min(length, original)
    return length


def _rope_parameters(text_config: Any) -> dict[str, Any]:
    """A config's RoPE settings: ``rope_parameters`` in recent transformers, ``rope_scaling`` in older configs."""
    return getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}


def rope_types(text_config: Any) -> set[str]:
    """The RoPE kinds a text config names (one per layer type where it has several: Gemma 3)."""
    rope = _rope_parameters(text_config)
    per_layer_type = [value for value in rope.values() if isinstance(value, dict)]
    return {str(p.get("rope_type", p.get("type", "default"))) for p in per_layer_type or [rope]}


def blocks_beside_gather(
    budget: int, per_block: int, max_num_seqs: int, num_layers: int, blocks_per_request: int
) -> int:
    """The most KV-cache blocks that fit in ``budget`` bytes beside the torch attention's gathered copy.

    That attention copies one layer's share of the blocks it reads: every running request's context padded
    to the longest, which is at most the model's length and at most the whole cache. For a model with a
    long context (128k tokens) the first bound alone would leave no room for any cache; the second one
    grows with the cache, so the two together give the cache whatever the copy leaves.
    """
    copies = max_num_seqs / num_layers  # bytes of gathered copy per block of the longest context, per cached byte
    full_copy = copies * blocks_per_request * per_block
    if budget - full_copy >= blocks_per_request * per_block:  # room for requests of the model's whole length
        return int(budget - full_copy) // per_block
    return max(1, min(blocks_per_request, int(budget / (per_block * (1 + copies)))))


def kv_bytes_per_block(model: Any, block_size: int) -> int:
    """Memory one KV-cache block of ``model`` takes, all layers, K and V, in the model's dtype."""
    num_layers, num_kv_heads, head_dim = kv_layout(model)
    dtype = next(model.parameters()).dtype
    return PagedKVCache.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)


def cpu_cache_blocks(model: Any, block_size: int) -> int:
    """Blocks of the KV cache that ``num_blocks=None`` gives on a CPU: CPU_CACHE_BYTES' worth, never more.

    ValueError if not even one block fits in that budget.
    """
    per_block = kv_bytes_per_block(model, block_size)
    if per_block > CPU_CACHE_BYTES:
        raise ValueError(
            f"one KV-cache block of {block_size} tokens takes {per_block / 2**20:,.0f} MiB, more than the"
            f" {CPU_CACHE_BYTES // 2**20} MiB that num_blocks=None gives the cache on a CPU: use a smaller"
            " block_size, or set num_blocks"
        )
    return CPU_CACHE_BYTES // per_block


def _check_conversion(model: Any, device: torch.device, dtype: torch.dtype | None) -> None:
    """Refuse to convert a model in place to another device or dtype while a live runner depends on it."""
    weight = next(model.parameters())
    if _placed(device) == weight.device and dtype in (None, weight.dtype):
        return  # nothing changes
    gc.collect()  # an engine that is gone but sits in a reference cycle (a listener holding it) must not count
    if _RUNNERS.get(model):
        wanted = f"{dtype or weight.dtype} on {device}".replace("torch.", "")
        current = f"{weight.dtype} on {weight.device}".replace("torch.", "")
        raise ValueError(
            f"the model runs in another Engine as {current}; an Engine with {wanted} would convert it in place"
            " (nn.Module.to) and break that engine. Use the same device and dtype, delete the other engine"
            " first, or load a second copy of the model"
        )


def _placed(device: torch.device) -> torch.device:
    """Where ``.to(device)`` puts tensors: plain "cuda" means the current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_device(device: Any) -> torch.device:
    """``"auto"`` is CUDA when present, else CPU; anything else must name a device torch can use."""
    if isinstance(device, torch.device):
        resolved = device
    elif isinstance(device, str):
        if device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            resolved = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device {device!r} is not a valid torch device: {error}") from None
    else:
        raise TypeError(f"device must be a string or torch.device, got {type(device).__name__}")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {str(resolved)!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: Any) -> torch.dtype | None:
    """None keeps the model's dtype; otherwise float32, bfloat16 or float16, as a torch.dtype or its name."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or a string, got {type(dtype).__name__}")
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype}")
    return dtype


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` is Triton on a CUDA GPU it compiles for, else torch; ``"triton"`` needs one of the two places
    Triton kernels run: such a GPU, or (for tests, slowly) Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and not why_no_triton(device) else "torch"
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(f"attention_backend='triton' needs the triton package ({INSTALL_TRITON})")
        if device.type == "cuda" and (why := why_no_triton(device)):
            raise ValueError(f"attention_backend='triton': {why}; use attention_backend='torch'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' runs on CUDA; on a CPU only under Triton's interpreter (TRITON_INTERPRET=1)"
            )
        if device.type != "cuda" and not interpreter_runs_kernels():
            raise ValueError(
                f"attention_backend='triton' on a CPU needs triton>={'.'.join(map(str, INTERPRETER_MIN_TRITON))}:"
                f" the interpreter of triton {triton_version()} cannot run labkit's kernels"
            )
    return backend


def why_no_triton(device: torch.device) -> str:
    """Why labkit's Triton kernels do not run on this CUDA device, "" when they do: no triton, one too old, a GPU
    older than the kernels are built for, or nothing to build their launchers with. ``attention_backend="auto"``
    then takes the torch attention, and with it decode runs without CUDA graphs (they replay Triton's launches):
    this says why, where a run shows neither."""
    if importlib.util.find_spec("triton") is None:
        return f"labkit's kernels need the triton package, which is not installed ({INSTALL_TRITON})"
    version = triton_version()
    if Version(version).release < MIN_TRITON:
        return f"labkit's kernels need triton>={'.'.join(map(str, MIN_TRITON))}, this is {version}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_TRITON_CAPABILITY:
        major, minor = MIN_TRITON_CAPABILITY
        return (
            f"labkit's kernels are built for compute capability {major}.{minor} and newer, this GPU has"
            f" {capability[0]}.{capability[1]}"
        )
    return missing_build_tools()


def missing_build_tools() -> str:
    """What Triton lacks here to build its kernels' C launchers on first use ("" when nothing): a C compiler
    ($CC, gcc or clang) and Python's headers. Slim container images often have neither; seen here, the engine
    picks the torch attention with this reason, instead of failing at its first step."""
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        return "Triton compiles its kernels' launchers with a C compiler, and none is installed (gcc, clang or $CC)"
    scheme = sysconfig.get_default_scheme()
    headers = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"]
    if not os.path.exists(os.path.join(headers, "Python.h")):
        return f"Triton compiles its kernels' launchers against Python's headers, and {headers} has no Python.h"
    return ""


def triton_version() -> str:
    """The installed triton's version, whichever distribution ships it (``triton``, or ``pytorch-triton``)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        import triton

        return triton.__version__


def interpreter_runs_kernels() -> bool:
    """Whether the installed triton's CPU interpreter can run labkit's kernels (tests on machines with no GPU)."""
    return Version(triton_version()).release >= INTERPRETER_MIN_TRITON


def resolve_use_cuda_graph(use_cuda_graph: bool | None, backend: str, device: torch.device, model: Any = None) -> bool:
    """None means on wherever the Triton backend runs on CUDA and ``model`` can be captured; True needs the Triton
    backend (graphs replay its fixed-shape launches; on a CPU, under the interpreter, replays are simulated for
    tests) and a model that can be captured."""
    blocker = None if model is None else graph_blocker(model)
    if use_cuda_graph is None:
        return backend == "triton" and device.type == "cuda" and blocker is None
    if use_cuda_graph and backend != "triton":
        raise ValueError("use_cuda_graph=True needs attention_backend='triton' (or 'auto' on CUDA with triton)")
    if use_cuda_graph and blocker is not None:
        raise ValueError(f"use_cuda_graph=True: {blocker}; leave use_cuda_graph unset (None) or set it to False")
    return use_cuda_graph


def graph_blocker(model: Any) -> str | None:
    """Why ``model``'s decode steps cannot be captured as a CUDA graph, or None if they can.

    transformers' dynamic RoPE picks its frequencies from the step's largest position with a Python ``if`` on a
    GPU value (in some versions), which waits for the GPU: a capture forbids that. longrope does too.
    """
    for kind in sorted(rope_types(model.config.get_text_config())):
        if "dynamic" in kind or kind == "longrope":
            return (
                f"its {kind!r} RoPE chooses its frequencies on the host in each step, which a CUDA graph cannot record"
            )
    return None


def default_gpu_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on GPUs that compute in it (compute capability 8.0+), float16 on older ones (e.g. a T4)."""
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def _eos_token_ids(model: Any) -> frozenset[int]:
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def device_name(device: torch.device) -> str:
    """What runs the model, in words: the GPU's name, or "cpu (<CPU model>)"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({_cpu_model()})"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
