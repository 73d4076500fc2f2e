#!/usr/bin/env bash
# The one command to run on a machine with an NVIDIA GPU: the GPU tests, then benchmarks/gpu_check.py.
# Everything lands under $OUT (default ./gpu_results): test log, results JSON, summary table, traces.
# Budget (under the 10 minutes of one command): the tests up to 200 s (Triton compiles each kernel variant
# once, some 80 of them), gpu_check.py up to 360 s, starting no part after 270 s and letting transformers' run
# go on at most 45 s past that (so it still prints its table); it rewrites its JSON after each part, so a run
# cut short keeps what it measured. A process that ignores the stop is killed 10 s on.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
mkdir -p "$OUT"
# TRITON_INTERPRET=0: the kernels run compiled even where the tests' conftest sees no /dev/nvidiactl.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# What labkit and this run need beside torch: a missing one shows here, in the first second.
"$PYTHON" -c "import torch, transformers, triton, rich, pytest, hypothesis, pynvml
print(torch.__version__, transformers.__version__, triton.__version__, torch.version.cuda)" > "$OUT/versions.txt" 2>&1
timeout -k 10 200 "$PYTHON" -m pytest -v --durations=15 -p no:cacheprovider tests/test_triton_attention.py tests/test_cuda_graphs.py \
    tests/test_async_scheduling.py::test_triton_path_with_decode_graphs \
    tests/test_async_scheduling.py::test_launching_a_decode_step_does_not_wait_for_the_gpu \
    tests/test_prefix_cache_parity.py::test_the_gpu_path_reads_shared_blocks_as_exactly \
    > "$OUT/gpu_tests.txt" 2>&1
tests=$?
timeout -k 10 360 "$PYTHON" benchmarks/gpu_check.py --device cuda --budget 270 --out "$OUT/gpu_check.json" \
    --traces "$OUT/traces" \
    > "$OUT/gpu_check.txt" 2>&1
check=$?
tail -n 5 "$OUT/gpu_tests.txt"
tail -n 40 "$OUT/gpu_check.txt"
echo "gpu tests: exit $tests; gpu_check: exit $check; results in $OUT"
exit $(( tests != 0 || check != 0 ))
