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
from torch.utils._pytree import tree_leaves

T = TypeVar("T")

META_NOTE = (
    "torch's device with no data, standing in for a GPU here: a tensor made without device= is on the CPU, and"
    " mixing it with these raises, as on a GPU"
)

# Ops that take a tensor on another device on a GPU too: indexing with CPU indices, copies and conversions between
# devices, and the *_as ops that only read the other tensor's shape or dtype.
_CROSSING = {
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.index_put,
    torch.index_put,
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


class _SameDevice(TorchFunctionMode):
    """Raise in an op that mixes a meta tensor with a CPU tensor of one dimension or more, as CUDA raises (a 0-d
    CPU tensor is a scalar to CUDA's ops, so it may be mixed)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _CROSSING:
            tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
            if any(t.is_meta for t in tensors) and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
                name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
                raise RuntimeError(
                    f"Expected all tensors to be on the same device, but found at least two devices, meta and cpu!"
                    f" (in {name}; on a GPU the same code raises with cuda:0 for meta)"
                )
        return func(*args, **kwargs)


def run_on_meta(call: Callable[[], T]) -> T | None:
    """``call()``, whose inputs are on meta, with every op checking its tensors' devices as on a GPU.

    None where the code reads a value on the host (``.item()``, ``.tolist()``, a Python ``if`` on a tensor), which
    meta has not got: up to that read it mixed no devices, and the rest is checked where there is a GPU.
    """
    try:
        with _SameDevice():
            return call()
    except RuntimeError as error:  # NotImplementedError too, which meta raises for an op it cannot run without data
        if isinstance(error, NotImplementedError) or "device" not in str(error).lower():
            return None
        raise
