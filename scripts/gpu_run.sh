#!/usr/bin/env bash
# The one command to run on a machine with an NVIDIA GPU: the GPU tests, then benchmarks/gpu_check.py.
# Everything lands under $OUT (default ./gpu_results): versions, test logs, results JSON, summary table, traces.
# Budget (under the 10 minutes of one command; each limit an environment variable, for a shorter slot):
# TESTS_SECONDS (180) for the tests (Triton compiles each kernel variant once, some 80 of them), in two pytest
# sessions so that a file that cannot import (hypothesis missing, say) costs only its own session: the kernel,
# graph and prefix-cache files get 3/4 of it, the CUDA cases of tests/test_async_scheduling.py what is left (at
# least 1/5). CHECK_SECONDS (350) for
# gpu_check.py, which starts no part after CHECK_BUDGET (260; by default CHECK_SECONDS - 90, or half of a
# CHECK_SECONDS under 180) and lets transformers' run go on at most 45 s past that (so it still prints its
# table); it rewrites its JSON after each part, so a run cut short keeps what it measured. A process that
# ignores the stop is killed 10 s on; a test that hangs for 90 s dumps every thread's stack into its log.
# A shorter slot: TESTS_SECONDS=100 CHECK_SECONDS=200 bash scripts/gpu_run.sh.
set -uo pipefail
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: a relative $OUT names the caller's folder, not the repo's
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
TESTS_SECONDS="${TESTS_SECONDS:-180}"
CHECK_SECONDS="${CHECK_SECONDS:-350}"
CHECK_BUDGET="${CHECK_BUDGET:-$(( CHECK_SECONDS >= 180 ? CHECK_SECONDS - 90 : CHECK_SECONDS / 2 ))}"
# TRITON_INTERPRET=0: the kernels run compiled even where the tests' conftest sees no /dev/nvidiactl.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# What labkit and this run need beside torch, one line each: a missing one shows here, in the first seconds; then
# whether Triton can build and launch a kernel at all.
"$PYTHON" - > "$OUT/versions.txt" 2>&1 <<'EOF'
import importlib
import importlib.metadata

distributions = importlib.metadata.packages_distributions()
for name in ("torch", "transformers", "triton", "rich", "pytest", "hypothesis", "pynvml", "numpy"):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        print(name, "missing")
        continue
    except Exception as error:  # installed but broken: as good as missing here, and the reason says why
        print(name, f"missing ({type(error).__name__}: {error})")
        continue
    version = getattr(module, "__version__", None)  # pynvml has none: its distribution (nvidia-ml-py) has
    for dist in distributions.get(name, []) if version is None else []:
        version = importlib.metadata.version(dist)
    print(name, version or "unknown")
    if name == "torch":
        print("torch.version.cuda", module.version.cuda)

# Triton builds a C launcher per kernel on first use: a missing compiler or Python.h shows here, not in every test.
from labkit.runtime.runner import missing_build_tools

print("triton build tools:", missing_build_tools() or "a C compiler and Python.h found")
try:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x, n: tl.constexpr):
        offsets = tl.arange(0, n)
        tl.store(x + offsets, tl.load(x + offsets) + 1)

    x = torch.zeros(16, device="cuda")
    add_one[(1,)](x, 16)
    print("triton compiles and launches a kernel:", "yes" if x.sum().item() == 16 else f"wrong result {x.tolist()}")
except Exception as error:
    print("triton compiles and launches a kernel: no,", type(error).__name__, str(error)[:2000])
EOF

# --continue-on-collection-errors: a test file that cannot import costs its own tests, not its session's others
# (a named test in such a file still ends its session: pytest finds no collector for it, and exits 4; so the
# hypothesis-based file, tests/test_async_scheduling.py, has its session alone).
PYTEST=("$PYTHON" -m pytest -v --durations=15 -p no:cacheprovider -o faulthandler_timeout=90
        --continue-on-collection-errors)
start=$SECONDS
timeout -k 10 $(( TESTS_SECONDS * 3 / 4 )) "${PYTEST[@]}" tests/test_triton_attention.py tests/test_cuda_graphs.py \
    tests/test_prefix_cache_parity.py::test_the_gpu_path_reads_shared_blocks_as_exactly \
    > "$OUT/gpu_tests_kernels.txt" 2>&1
kernel_tests=$?
cases_seconds=$(( TESTS_SECONDS - (SECONDS - start) ))
(( cases_seconds < TESTS_SECONDS / 5 )) && cases_seconds=$(( TESTS_SECONDS / 5 ))
timeout -k 10 "$cases_seconds" "${PYTEST[@]}" \
    tests/test_async_scheduling.py::test_triton_path_with_decode_graphs \
    tests/test_async_scheduling.py::test_launching_a_decode_step_does_not_wait_for_the_gpu \
    > "$OUT/gpu_tests_cases.txt" 2>&1
case_tests=$?
timeout -k 10 "$CHECK_SECONDS" "$PYTHON" benchmarks/gpu_check.py --device cuda --budget "$CHECK_BUDGET" \
    --out "$OUT/gpu_check.json" --traces "$OUT/traces" \
    > "$OUT/gpu_check.txt" 2>&1
check=$?
cat "$OUT/versions.txt"
tail -n 5 "$OUT/gpu_tests_kernels.txt" "$OUT/gpu_tests_cases.txt"
tail -n 40 "$OUT/gpu_check.txt"
# 124: stopped at its time limit; 137: killed 10 s after that; pytest's 4: a named test not found, 5: no test ran.
echo "gpu tests: kernels, graphs and prefix cache exit $kernel_tests, async scheduling exit $case_tests;" \
    "gpu_check: exit $check; results in $OUT"
exit $(( kernel_tests != 0 || case_tests != 0 || check != 0 ))
