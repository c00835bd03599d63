#!/usr/bin/env bash
# One run on a lent GPU machine (the device tool): `bash tools/device_check.sh` from the repo
# root. What fleetllm imports is all in that machine's image (torch, transformers, safetensors,
# tokenizers, numpy, tqdm, cloudpickle, ninja, setuptools, pytest, pytest-timeout); wheels
# under .whl/, if carried, are installed into /tmp/site first (the device README's recipe).
# Not in that image (2026-11): msgspec (the engine-core wire format: fleetllm.engine.core_*)
# and xgrammar (structured outputs); test files importing them need them carried as wheels.
#
# Parts, each under `timeout`, all inside a ~5.5-minute deadline (later parts are skipped
# when time is short); every log lands in $OUT (8 files at most):
#   env.log             machine, driver, torch/transformers versions, compilers
#   test_cuda.log       tests/worker/test_cuda.py: the CUDA path (parity with HF, memory,
#                       sleep, mp)
#   cuda_report.jsonl   the figures test_cuda.py measured (agreement, blocks, bytes freed)
#   bench.log           fleetllm bench throughput --device cuda (llama-125m fp32, llama-1b bf16)
#   bench_125m.json     the llama-125m figures as JSON
#   cpu_tests.log       engine test files on the CPU (CUDA hidden) with this image's torch
#   cuda_engine_tests.log  the same engine test files with device "auto", i.e. on the GPU
#   summary.log         exit codes and seconds per part
# Exit status: test_cuda.py's.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fleetllm_device_out}
mkdir -p "$OUT"
START=$(date +%s)
DEADLINE=$((START + ${DEVICE_CHECK_SECONDS:-330}))
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions FLEETLLM_CUDA_REPORT="$OUT/cuda_report.jsonl"
: > "$OUT/summary.log"

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || { echo "wheel install failed" | tee -a "$OUT/summary.log"; exit 3; }
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"  # fleetllm from this checkout

left() { echo $((DEADLINE - $(date +%s))); }

# part NAME LOG SECONDS CMD...: run CMD under timeout min(SECONDS, time left), tee to LOG.
part() {
    local name=$1 log=$2 want=$3; shift 3
    local budget; budget=$(left)
    [ "$want" -lt "$budget" ] && budget=$want
    if [ "$budget" -lt 20 ]; then
        echo "$name: skipped, ${budget}s left" | tee -a "$OUT/summary.log"
        return 0
    fi
    local t0; t0=$(date +%s)
    echo "== $name (timeout ${budget}s): $*" | tee -a "$log"
    timeout -k 10 "$budget" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "$name: rc=$rc in $(( $(date +%s) - t0 ))s (124: timed out)" | tee -a "$OUT/summary.log"
    return "$rc"
}

{
    date -u; uname -a; nproc; free -g
    nvidia-smi || echo "nvidia-smi failed"
    echo "compilers: gcc=$(command -v gcc) g++=$(command -v g++) c++=$(command -v c++)" \
         "nvcc=$(command -v nvcc) ninja=$(command -v ninja)"
    python3 - <<'EOF'
import sys, torch, transformers
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
      torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    print("device", p.name, f"sm_{p.major}{p.minor}", f"{total / 2**30:.1f} GiB,",
          f"{free / 2**30:.1f} GiB free")
print("transformers", transformers.__version__)
import fleetllm
from fleetllm import LLM  # noqa: F401
print("fleetllm", fleetllm.__version__, fleetllm.__file__)
EOF
} 2>&1 | tee "$OUT/env.log"

# 1. The CUDA tests (no -x: one run on the machine should report every failure).
part test_cuda "$OUT/test_cuda.log" 210 \
    python3 -m pytest -q tests/worker/test_cuda.py -p no:cacheprovider -rfEs --durations=12 \
    ${CUDA_TEST_ARGS:-}
CUDA_RC=$?

# 2. Throughput on the GPU: the benchmark takes every engine flag, --device included.
part bench_125m "$OUT/bench.log" 50 \
    python3 -m fleetllm.benchmarks.throughput --preset llama-125m --device cuda \
    --compare none --no-roofline --json "$OUT/bench_125m.json"
part bench_1b "$OUT/bench.log" 50 \
    python3 -m fleetllm.benchmarks.throughput --preset llama-1b --device cuda \
    --compare none --no-roofline --repeat 1

# 3. Engine tests on the CPU with this image's torch/transformers (CUDA hidden; the C++ CPU
#    kernels compile at first use if a compiler is here, else the PyTorch path runs).
ENGINE_TESTS="tests/engine/test_engine.py tests/core/test_prefix_caching.py
    tests/worker/test_sampler.py"
# shellcheck disable=SC2086
CUDA_VISIBLE_DEVICES="" part cpu_tests "$OUT/cpu_tests.log" 80 \
    python3 -m pytest -q $ENGINE_TESTS -p no:cacheprovider -rfE --durations=5
# 4. The same engine tests with device "auto": on the GPU (they compare with HF on the CPU).
# shellcheck disable=SC2086
part cuda_engine_tests "$OUT/cuda_engine_tests.log" 80 \
    python3 -m pytest -q $ENGINE_TESTS -p no:cacheprovider -rfE --durations=5

echo "total $(( $(date +%s) - START ))s; test_cuda rc=$CUDA_RC" | tee -a "$OUT/summary.log"
exit "$CUDA_RC"
