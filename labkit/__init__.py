"""labkit: a teaching lab for how LLM inference servers batch requests.

The package is layered, and each layer imports only the ones below it:

* ``labkit.core`` - blocks, scheduler, requests, the engine loop, the simulated model. Plain Python, no torch.
* ``labkit.runtime`` - torch and transformers: the model runner, paged attention, sampling, ``generate_batch``.
* ``labkit.serving`` - metrics, workloads, the online driver, the baselines and ``labkit bench``.
* ``labkit.viz`` - widgets that draw StepReports; ``labkit.models`` - the bundled model and loaders;
  ``labkit.exercises`` - the learners' checker.

``import labkit`` loads only the core (and ``generate_batch``'s torch-free front); the other subpackages
load on first use (``labkit.viz.BlockMap``).
"""

from __future__ import annotations

import importlib
from typing import Any

from labkit.core import engine as _engine
from labkit.core.config import EngineConfig
from labkit.core.engine import Engine
from labkit.core.report import StepReport, load_trace, save_trace
from labkit.core.request import RequestOutput, SamplingParams, where_outputs_part
from labkit.core.sim import CostModel, SimulatedModel
from labkit.runtime.hf import GenerationResult, generate_batch

SUBPACKAGES = ("core", "exercises", "models", "runtime", "serving", "viz")


def _transformers_runner(model: Any, config: EngineConfig, **parts: Any) -> Any:
    """The runner for a transformers model; torch is imported here, the first time a real model runs."""
    from labkit.runtime.runner import ModelRunner

    return ModelRunner(model, config, **parts)


_engine.default_runner_factory = _transformers_runner


def __getattr__(name: str) -> Any:
    """Load a subpackage on first use, so ``import labkit`` stays light and ``labkit.models.load`` still works."""
    if name in SUBPACKAGES:
        return importlib.import_module(f"labkit.{name}")
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


__all__ = [
    "CostModel",
    "Engine",
    "EngineConfig",
    "GenerationResult",
    "RequestOutput",
    "SamplingParams",
    "SimulatedModel",
    "StepReport",
    "generate_batch",
    "load_trace",
    "save_trace",
    "where_outputs_part",
]
__version__ = "0.1.0"
