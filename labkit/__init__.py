"""labkit: a teaching lab for how LLM inference servers batch requests.

The engine's core (``labkit.blocks``, ``labkit.scheduler``, ``labkit.sim``) is plain Python; torch and
transformers are imported only when a real model runs, so ``import labkit`` stays light.
"""

from labkit.config import EngineConfig
from labkit.engine import Engine
from labkit.hf import GenerationResult, generate_batch
from labkit.report import StepReport, load_trace, save_trace
from labkit.request import RequestOutput, SamplingParams
from labkit.sim import CostModel, SimulatedModel

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
]
__version__ = "0.1.0"
