# Sourced by the one-call device scripts (check_merged.sh, row_chain_ab.sh, ...): sets OUT (default
# bench/gpu/results) and the compile cache, records the GPU, driver and host CPU in $OUT/device.txt, then runs the
# GPU test files (or those in ${TESTS}) (xdist with 8 workers where installed) under ${TEST_S:-200} s into $OUT/pytest_gpu.txt, so that a
# call's figures always come with the correctness of the code they measure (SKIP_GPU_TESTS=1: not run, for a call
# whose branch changes no src/ and checks its own outputs). Run from the repository root with PYTHONPATH set.
OUT=${OUT:-bench/gpu/results}
mkdir -p "$OUT"
export CUVIL_CACHE_DIR=/tmp/cuvil-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
python3 -c "from cuvil.targets.x86.cpu import cpu_label; print(cpu_label())" >> "$OUT/device.txt" 2>&1
if [ -z "${SKIP_GPU_TESTS:-}" ]; then
    NX=""; python3 -c "import xdist" 2>/dev/null && NX="-n 8"
    timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider $NX -rxXs ${TESTS:-tests/test_gpu_*.py} > "$OUT/pytest_gpu.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
    tail -3 "$OUT/pytest_gpu.txt"
fi
