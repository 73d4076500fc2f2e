"""The Triton kernels compile for real GPUs, with no GPU here: an H100/H200 (sm_90) and a T4 (sm_75).

Triton's CPU interpreter runs a kernel's Python, not its compiler, so a kernel can pass every interpreter
test and still fail to build for a GPU, or build into code that spills registers to memory (slow). Triton
compiles ahead of time for a named target without a device, and its bundled ``cuobjdump`` reports each
build's registers and stack; this file builds the variants the engine launches and checks both.

Run as a script to see the table: ``python tests/test_kernel_build.py`` (``--json`` for machines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
# (compute capability, dtype, query heads per KV head, head size, decode-only, sliding window[, splits])
VARIANTS = [
    *[(90, dtype, 7, 64, decode, 0) for dtype in ("bf16", "fp16") for decode in (True, False)],  # Qwen2.5-0.5B
    *[(90, dtype, 8, 128, decode, 0) for dtype in ("bf16", "fp16") for decode in (True, False)],  # Llama-3-8B
    (90, "bf16", 4, 256, False, 4096),  # Gemma-like: large heads, sliding window
    (90, "bf16", 1, 64, True, 0),  # multi-head attention, no grouping
    *[(75, "fp16", group, head_dim, decode, 0) for group, head_dim in ((7, 64), (8, 128)) for decode in (True, False)],
    (75, "fp16", 4, 256, False, 4096),
    (90, "fp32", 7, 64, False, 0),  # parity runs: may spill, must build
    (75, "fp32", 8, 128, True, 0),
    # Small decode batches split each context (decode_splits): the split variants and the kernel that merges them.
    (90, "bf16", 7, 64, True, 0, 16),
    (90, "bf16", 8, 128, True, 0, 4),
    (75, "fp16", 7, 64, True, 0, 16),
    (75, "fp16", 8, 128, True, 0, 8),
]
MERGES = [(90, "bf16", 64, 16), (90, "bf16", 128, 4), (75, "fp16", 64, 16), (75, "fp16", 128, 8)]
SHARED_MEMORY_LIMIT = {90: 227 * 1024, 75: 64 * 1024}  # per block, with the opt-in Triton asks for
MAX_STACK = 16  # bytes per thread: a register or two that a compiler parks (the spilling layouts had 72 to 1,488)


def build(
    capability: int, dtype: str, group: int, head_dim: int, decode_only: bool, window: int, splits: int = 1
) -> dict[str, Any]:
    """Compile the attention kernel for ``sm_<capability>`` as paged_attention would launch it; its resources."""
    import triton

    from labkit.runtime import triton_attention as kernels

    kernel = kernels._paged_attention_kernel
    head_pad = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16, triton.next_power_of_2(group))
    tile, num_warps = kernels.launch_shape(head_pad)
    constants = dict(
        BLOCK_SIZE=16, GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_M=block_m, BLOCK_Q=block_m // group,
        TILE=tile, WIDE_OFFSETS=False, WINDOW=window, DECODE_ONLY=decode_only, NUM_SPLITS=splits,
        PRECISION="ieee" if dtype == "fp32" else "tf32", DOT_FP32=False,
    )  # fmt: skip
    pointers = ["out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr"]
    signature = {name: f"*{dtype}" for name in pointers}
    signature |= {name: "*i32" for name in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
    signature |= {"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32", "scale_log2": "fp32"}
    return {"tile": tile, "num_warps": num_warps, **compile_for(kernel, signature, constants, capability, num_warps)}


def build_merge(capability: int, dtype: str, head_dim: int, splits: int) -> dict[str, Any]:
    """Compile the kernel that merges a split decode's parts; its resources."""
    import triton

    from labkit.runtime import triton_attention as kernels

    constants = dict(HEAD_DIM=head_dim, HEAD_PAD=max(16, triton.next_power_of_2(head_dim)), NUM_SPLITS=splits)
    signature = {"out_ptr": f"*{dtype}", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
    return compile_for(kernels._merge_splits_kernel, signature, constants, capability, num_warps=4)


def compile_for(
    kernel: Any, signature: dict[str, str], constants: dict[str, Any], capability: int, num_warps: int
) -> dict[str, Any]:
    """Build ``kernel`` for ``sm_<capability>`` (arguments not in ``signature`` are constants or i32)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name in kernel.arg_names:
        signature.setdefault(name, "constexpr" if name in constants else "i32")
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=num_warps))
    return {"shared": compiled.metadata.shared, **resource_usage(compiled.asm["cubin"])}


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack bytes (spilled registers) of a kernel, from cuobjdump; {} without it."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True)
    for line in report.stdout.splitlines():
        if "REG:" in line:
            fields = dict(item.split(":", 1) for item in line.split() if ":" in item)
            return {"registers": int(fields["REG"]), "stack": int(fields["STACK"])}
    return {}


def build_all() -> list[dict[str, Any]]:
    jobs = []
    for variant in VARIANTS:
        names = ("capability", "dtype", "group", "head_dim", "decode_only", "window", "splits")
        row = {"kernel": "attention", "splits": 1} | dict(zip(names, variant, strict=False))
        jobs.append((row, build, variant))
    for variant in MERGES:
        row = {"kernel": "merge"} | dict(zip(("capability", "dtype", "head_dim", "splits"), variant, strict=True))
        jobs.append((row, build_merge, variant))
    rows = []
    for row, function, variant in jobs:
        try:
            row |= function(*variant)
        except Exception as error:  # reported per variant: one failure must not hide the others
            row["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
        rows.append(row)
    return rows


def name_of(b: dict[str, Any]) -> str:
    shape = f"group {b['group']} " if "group" in b else ""
    return f"{b['kernel']} sm_{b['capability']} {b['dtype']} {shape}head_dim {b['head_dim']} splits {b['splits']}"


@pytest.fixture(scope="module")
def builds() -> list[dict[str, Any]]:
    pytest.importorskip("triton")
    from packaging.version import Version

    from labkit.runtime.runner import MIN_TRITON, triton_version

    if Version(triton_version()).release < MIN_TRITON:  # e.g. the one that torch 2.6 pins
        pytest.skip(f"labkit's kernels need triton>={'.'.join(map(str, MIN_TRITON))}, this is {triton_version()}")
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("this triton has no compiler backends")
    if "nvidia" not in backends:
        pytest.skip("this triton cannot compile for NVIDIA GPUs")
    # The interpreter replaces the compiler: build in a process without it.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache  # a fresh build, not a cached one
        done = subprocess.run(
            [sys.executable, __file__, "--json"], capture_output=True, text=True, env=env, timeout=600
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_variant_builds(builds: list[dict[str, Any]]) -> None:
    failed = {name_of(b): b["error"] for b in builds if "error" in b}
    assert not failed


def test_half_precision_builds_do_not_spill_and_fit_shared_memory(builds: list[dict[str, Any]]) -> None:
    for b in builds:
        name = name_of(b)
        assert b["shared"] <= SHARED_MEMORY_LIMIT[b["capability"]], f"{name}: {b['shared']} bytes of shared memory"
        if b["dtype"] != "fp32" and "stack" in b:  # a few bytes of stack are noise; spilling tiles is not
            assert b["stack"] <= MAX_STACK, f"{name} spills {b['stack']} bytes per thread ({b['registers']} registers)"


if __name__ == "__main__":
    rows = build_all()
    if "--json" in sys.argv:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(row)
