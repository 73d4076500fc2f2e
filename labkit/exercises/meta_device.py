"""torch's meta device standing in for a GPU in the exercises' checks, on machines without one.

A meta tensor has a shape, a dtype and a device but no data, so a learner's code runs on it without a GPU. A tensor
the code makes without ``device=`` lands on the CPU, as it would next to CUDA tensors, and mixing the two should
raise, as CUDA does. Meta checks that in most ops (elementwise ones, torch.where, torch.cat), not in all: matmul,
gather, index_select and searchsorted let a CPU tensor through. Run under :func:`run_on_meta`, every op checks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from labkit.core.interrupts import HeldInterrupt

T = TypeVar("T")

META_NOTE = (
    "torch's device with no data, standing in for a GPU here: a tensor made without device= is on the CPU, and"
    " mixing it with these raises, as on a GPU"
)

# Indexing a tensor on a GPU takes indices on the CPU, but not a CPU tensor indexed with GPU indices, nor values
# of one dimension or more from the CPU.
_INDEXING = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.index_put,
    torch.index_put,
}
# Ops that take a tensor on another device on a GPU too: copies and conversions between devices, and the *_as ops
# that only read the other tensor's shape or dtype.
_CROSSING = {
    torch.Tensor.to,
    torch.Tensor.copy_,
    torch.Tensor.new_tensor,
    torch.Tensor.type_as,
    torch.Tensor.expand_as,
    torch.Tensor.view_as,
    torch.Tensor.reshape_as,
    torch.as_tensor,
    torch.tensor,
}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _on_cpu(t: torch.Tensor) -> bool:
    """A CPU tensor that CUDA would not take as a scalar: one of one dimension or more."""
    return t.device.type == "cpu" and t.dim() > 0


class _SameDevice(TorchFunctionMode):
    """Raise in an op that mixes a meta tensor with a CPU tensor of one dimension or more, as CUDA raises. A 0-d CPU
    tensor is a scalar to CUDA's ops: it goes to meta, where some ops (masked_fill) would refuse it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _INDEXING:  # (tensor, indices) to read; (tensor, indices, values) to write
            indexed, indices = args[0], _tensors(args[1])
            values = args[2] if len(args) > 2 else kwargs.get("values")
            on_meta = any(t.is_meta for t in indices + _tensors(values))
            mixed = (indexed.device.type == "cpu" and on_meta) or (
                indexed.is_meta and isinstance(values, torch.Tensor) and _on_cpu(values)
            )
        elif func not in _CROSSING:
            tensors = _tensors((args, kwargs))
            mixed = any(t.is_meta for t in tensors) and any(_on_cpu(t) for t in tensors)
            if not mixed and any(t.is_meta for t in tensors):
                args, kwargs = tree_map(_scalar_to_meta, (args, kwargs))
        else:
            mixed = False
        if mixed:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, meta and cpu!"
                f" (in {name}; on a GPU the same code raises with cuda:0 for meta)"
            )
        return func(*args, **kwargs)


def _scalar_to_meta(leaf: Any) -> Any:
    """A CPU tensor onto meta: in an op that mixes no devices, only a 0-d one, a scalar to CUDA, can be left."""
    return leaf.to("meta") if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" else leaf


def _warm_up() -> None:
    """The first ops on meta import much of torch (about a second): done with a Ctrl-C held, since one that lands
    in an import leaves the module half-imported, and every later check failing in that process."""
    held = HeldInterrupt()
    held.hold()
    try:
        rows = torch.empty(2, 3, device="meta")
        torch.where(rows > 0, rows, 0.0).softmax(-1).cumsum(-1)
    finally:
        held.deliver()


def run_on_meta(call: Callable[[], T]) -> T | None:
    """``call()``, whose inputs are on meta, with every op checking its tensors' devices as on a GPU.

    None where the code reads a value on the host (``.item()``, ``.tolist()``, a Python ``if`` on a tensor), which
    meta has not got: up to that read it mixed no devices, and the rest is checked where there is a GPU.
    """
    _warm_up()
    try:
        with _SameDevice():
            return call()
    except RuntimeError as error:  # NotImplementedError too, which meta raises for an op it cannot run without data
        if isinstance(error, NotImplementedError) or "device" not in str(error).lower():
            return None
        raise
