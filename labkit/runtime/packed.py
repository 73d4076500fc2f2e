"""Prepacked weights for a model's linear layers on a CPU.

A decode step multiplies a handful of token rows by every weight matrix of the model, so on a CPU its
time goes to streaming those matrices through the caches, not to arithmetic. ``nn.Linear`` calls MKL's
GEMM, which repacks the weight matrix into its own blocked layout on every call: for a few rows, that
copy is a large part of the work. oneDNN (``torch.ops.mkldnn``, what ``torch.compile`` uses for frozen
CPU weights) can pack each matrix once; a step then reads the packed copy directly. On steps of 1 to 64
rows the linear layers run 1.3-1.9x faster (``benchmarks/packed_bench.py``); the results equal
``nn.Linear``'s up to float rounding. Steps of many rows (long prefill chunks) are bound by arithmetic
instead, where packing gains little; they keep ``nn.Linear``. That also bounds the kernels oneDNN
builds: one per weight shape and row count, the first time that count is seen (about a millisecond each).

The packed copies live beside the model (its own weights are untouched, so ``model.generate`` and
anything else using the model see no change) and cost one more copy of the linear weights in memory.
A layer whose weights change (training, loading, a replaced parameter) is packed again before the
next step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# Rows up to which a layer runs on its packed weights; oneDNN picks the packed layout for this many.
PACKED_MAX_ROWS = 64


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
        for layer in self.layers:
            if "forward" in layer.module.__dict__:
                continue
            if layer.stale():
                layer.pack()
            layer.module.__dict__["forward"] = layer
            switched.append(layer.module)
        try:
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
        """Copy the layer's current weight into oneDNN's layout, and remember what the copy was made from."""
        self.source = _source(self.module)
        with torch.no_grad():
            self.weight = torch.ops.mkldnn._reorder_linear_weight(self.module.weight.detach(), PACKED_MAX_ROWS)
        self.bias = None if self.module.bias is None else self.module.bias.detach()

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
