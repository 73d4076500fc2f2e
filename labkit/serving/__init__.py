"""Serving measured: TTFT/TPOT/ITL metrics, seeded workloads, the online driver, baselines and ``labkit bench``.

Its modules load on first use (``labkit.serving.metrics`` after a plain ``import labkit``), since some of
them import torch.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def __getattr__(name: str) -> ModuleType:
    """Import the submodule ``name`` the first time it is asked for."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise  # the submodule exists but something it imports is missing
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
