"""Prepacked weights for a model's linear layers on a CPU.

A decode step multiplies a handful of token rows by every weight matrix of the model, so on a CPU its
time goes to streaming those matrices through the caches, not to arithmetic. ``nn.Linear`` calls MKL's
GEMM, which repacks the weight matrix into its own blocked layout on every call: for a few rows, that
copy is a large part of the work. oneDNN (``torch.ops.mkldnn``, what ``torch.compile`` uses for frozen
CPU weights) can pack each matrix once; a step then reads the packed copy directly. On steps of 4 to 64
rows the linear layers run 1.3-1.8x faster (``benchmarks/packed_bench.py``); the results equal
``nn.Linear``'s up to float rounding.
Steps of many rows (long prefill chunks) are bound by arithmetic instead, where packing gains little;
they keep ``nn.Linear``. That also bounds the kernels oneDNN builds: one per weight shape and row
count, the first time that count is seen (about a millisecond each).

The packed copies live beside the model (its own weights are untouched, so ``model.generate`` and
anything else using the model see no change) and cost one more copy of the linear weights in memory.
They are taken when the engine is created: weights changed afterwards are not seen by the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

# Rows up to which a layer runs on its packed weights; oneDNN picks the packed layout for this many.
PACKED_MAX_ROWS = 64


class PackedLinears:
    """oneDNN-packed copies of every ``nn.Linear`` weight of ``model``, switched on per step by :meth:`active`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards: dict[torch.nn.Module, Any] = {}
        with torch.no_grad():
            for module in model.modules():
                if type(module) is torch.nn.Linear:
                    self.forwards[module] = _packed_forward(module)

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
        if not self.forwards:
            return
        layer, forward = next(iter(self.forwards.items()))
        x = torch.linspace(-1, 1, 3 * layer.in_features, dtype=layer.weight.dtype).view(3, -1)
        with torch.no_grad():
            if not torch.allclose(forward(x), layer(x), rtol=1e-2, atol=1e-2):
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

        The packed function goes into each module's instance ``__dict__``, where it shadows the class's
        ``forward``; that is a dictionary write per layer, cheap enough to do every step.
        """
        for module, forward in self.forwards.items():
            module.__dict__["forward"] = forward
        try:
            yield
        finally:
            for module in self.forwards:
                module.__dict__.pop("forward", None)


def _packed_forward(module: torch.nn.Linear) -> Any:
    weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACKED_MAX_ROWS)
    bias = None if module.bias is None else module.bias.detach()
    linear_pointwise = torch.ops.mkldnn._linear_pointwise
    max_elements = PACKED_MAX_ROWS * module.in_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() > max_elements:
            return F.linear(x, module.weight, module.bias)
        return linear_pointwise(x.contiguous(), weight, bias, "none", [], "")

    return forward
