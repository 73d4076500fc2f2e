"""Prepacked weights for a model's linear layers on a CPU.

A decode step multiplies a handful of token rows by every weight matrix of the model, so on a CPU its
time goes to streaming those matrices through the caches, not to arithmetic. ``nn.Linear`` calls MKL's
GEMM, which repacks the weight matrix into its own blocked layout on every call: for a few rows, that
copy is a large part of the work. oneDNN (``torch.ops.mkldnn``, what ``torch.compile`` uses for frozen
CPU weights) can pack each matrix once; a step then reads the packed copy directly. Whether that wins depends
on the CPU and the matrices (``benchmarks/packed_bench.py``, the course's small model on one thread: 1.3-1.9x
faster on steps of 1 to 64 rows on an AMD EPYC, 0.6-1.0x on an Intel Xeon, where MKL's small calls are
cheaper than oneDNN's), so by default an engine times both once per model and keeps the faster
(:meth:`PackedLinears.if_faster`). The results equal ``nn.Linear``'s up to float rounding. Steps of many rows
(long prefill chunks) are bound by arithmetic
instead, where packing gains little; they keep ``nn.Linear``. That also bounds the kernels oneDNN
builds: one per weight shape and row count, the first time that count is seen (about a millisecond each).

The packed copies live beside the model (its own weights are untouched, so ``model.generate`` and
anything else using the model see no change) and cost one more copy of the linear weights in memory.
A layer whose weights change (training, loading, a replaced parameter) is packed again before the
next step.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# Rows up to which a layer runs on its packed weights; oneDNN picks the packed layout for this many.
PACKED_MAX_ROWS = 64
# How packing is judged for a model: its first layers (a decoder layer's projections, not the vocabulary-sized
# head) on a few row counts a decode step has, best of some rounds; kept when it takes at most this share of
# nn.Linear's time.
TIMED_LAYERS, TIMED_ROWS, TIMED_ROUNDS, KEEP_IF_WITHIN = 8, (1, 8, 32), 5, 0.9
_FASTER: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()  # model -> packing won


class PackedLinears:
    """oneDNN-packed copies of every ``nn.Linear`` weight of ``model``, switched on per step by :meth:`active`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers = [PackedLayer(module) for module in model.modules() if type(module) is torch.nn.Linear]

    @classmethod
    def of(cls, model: torch.nn.Module) -> PackedLinears | None:
        """Packed weights for ``model``, or None where packing is not :meth:`supported` or oneDNN refuses it.

        Builds of torch whose oneDNN lacks the packed kernels for this CPU raise RuntimeError on the first
        layer: the model then simply runs with its own ``nn.Linear`` layers.
        """
        if not cls.supported(model):
            return None
        try:
            packed = cls(model)
            packed.check_first_layer()
        except RuntimeError:
            return None
        return packed

    @classmethod
    def if_faster(cls, model: torch.nn.Module) -> PackedLinears | None:
        """Packed weights for ``model`` where this CPU runs them faster than ``nn.Linear``, else None.

        The first time for a model (a few milliseconds) its first layers are timed both ways; every later engine
        on that model in this process gets the same answer, so runs compared in one session run the same kernels,
        and where packing lost, no later engine packs the weights at all.
        """
        if _FASTER.get(model) is False:
            return None
        packed = cls.of(model)
        if packed is None:
            return None
        if model not in _FASTER:
            _FASTER[model] = packed.faster_than_linear()
        return packed if _FASTER[model] else None

    def faster_than_linear(self) -> bool:
        """Whether the packed layers take at most KEEP_IF_WITHIN of nn.Linear's time on a few decode-sized steps."""
        layers = self.layers[:TIMED_LAYERS]
        inputs = [
            [torch.ones(rows, layer.module.in_features, dtype=layer.module.weight.dtype) for layer in layers]
            for rows in TIMED_ROWS
        ]

        def seconds(packed: bool) -> float:
            start = time.perf_counter()
            for step in inputs:
                for layer, x in zip(layers, step, strict=True):
                    layer(x) if packed else F.linear(x, layer.module.weight, layer.module.bias)
            return time.perf_counter() - start

        best = {True: float("inf"), False: float("inf")}
        with torch.inference_mode():
            seconds(True), seconds(False)  # oneDNN builds its kernel for each shape on first use
            for _ in range(TIMED_ROUNDS):
                for packed in best:
                    best[packed] = min(best[packed], seconds(packed))
        return best[True] <= KEEP_IF_WITHIN * best[False]

    def check_first_layer(self) -> None:
        """Raise RuntimeError unless the first packed layer computes what ``nn.Linear`` computes."""
        if not self.layers:
            return
        layer = self.layers[0]
        module = layer.module
        x = torch.linspace(-1, 1, 3 * module.in_features, dtype=module.weight.dtype).view(3, -1)
        with torch.no_grad():
            if not torch.allclose(layer(x), module(x), rtol=1e-2, atol=1e-2):
                raise RuntimeError("oneDNN's packed linear disagrees with nn.Linear")

    @staticmethod
    def supported(model: torch.nn.Module) -> bool:
        """Whether oneDNN can pack the weights: a CPU model in float32 or bfloat16, and torch built with oneDNN."""
        parameter = next(model.parameters(), None)
        return (
            parameter is not None
            and parameter.device.type == "cpu"
            and parameter.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )

    @contextmanager
    def active(self) -> Iterator[None]:
        """Route the linear layers to their packed weights inside the block, then restore ``nn.Linear.forward``.

        A layer whose weight or bias changed since it was packed (trained, loaded, replaced) is packed
        again first. The packed layer goes into each module's instance ``__dict__``, where it shadows the
        class's ``forward``: a dictionary write per layer, cheap enough to do every step. A layer that
        already has a ``forward`` of its own there (a hook, as accelerate installs) keeps it, unpacked.
        """
        switched = []
        try:  # a re-pack that fails (out of memory, a Ctrl-C) leaves no layer switched outside the block
            for layer in self.layers:
                if "forward" in layer.module.__dict__:
                    continue
                if layer.stale():
                    layer.pack()
                layer.module.__dict__["forward"] = layer
                switched.append(layer.module)
            yield
        finally:
            for module in switched:
                module.__dict__.pop("forward", None)


class PackedLayer:
    """One ``nn.Linear`` with a packed copy of its weight; called like the layer's ``forward``."""

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module
        self.max_elements = PACKED_MAX_ROWS * module.in_features
        self.pack()

    def pack(self) -> None:
        """Copy the layer's current weight into oneDNN's layout, and remember what the copy was made from.

        What it was made from is noted last, once the copy is whole: a pack cut short leaves the layer stale.
        """
        source = _source(self.module)
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(self.module.weight.detach(), PACKED_MAX_ROWS)
        self.bias = None if self.module.bias is None else self.module.bias.detach()
        self.source = source

    def stale(self) -> bool:
        """Whether the layer's weight or bias was replaced, given new data or written in place since it was packed."""
        weight, bias, marks = _source(self.module)
        return weight is not self.source[0] or bias is not self.source[1] or marks != self.source[2]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.max_elements:
            return F.linear(x, self.module.weight, self.module.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")


def _source(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
    """A layer's weight and bias, each with its version counter, which every in-place write bumps, and the
    address of its data, which ``param.data = ...`` (and so ``model.to(dtype)``) changes without a bump.

    Read from ``_parameters``: ``module.weight`` goes through ``nn.Module.__getattr__``, a microsecond
    per lookup, and this runs for every layer on every step.
    """
    weight, bias = module._parameters["weight"], module._parameters["bias"]
    marks = (weight._version, weight.data_ptr()) + (() if bias is None else (bias._version, bias.data_ptr()))
    return weight, bias, marks
