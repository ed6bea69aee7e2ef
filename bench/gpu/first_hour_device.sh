#!/usr/bin/env bash
# Issue 27's checks that need the device machine: the CPU identification and `cuvil doctor` on its Intel Xeon
# (this VM is AMD), the one Model interface with a real GPU launch, and the vector-math / fused-attention
# figures on that CPU. Run from the repository root with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
set -u
OUT=${OUT:-bench/gpu/results}
mkdir -p "$OUT"
export CUVIL_CACHE_DIR=/tmp/cuvil-cache
{ echo "## date"; date -u; echo "## cuvil doctor"; python3 -m cuvil doctor; } > "$OUT/doctor.txt" 2>&1
python3 -m cuvil doctor --json > "$OUT/doctor.json" 2>&1
python3 -m pytest -q -p no:cacheprovider tests/test_cpu.py tests/test_doctor.py tests/test_model_interface.py \
    tests/test_gpu_bundle.py > "$OUT/pytest_first_hour.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_first_hour.txt"
python3 bench/gpu/model_interface_check.py --json "$OUT/model_interface_h200.json" > "$OUT/model_interface_h200.txt" 2>&1
echo "rc=$?" >> "$OUT/model_interface_h200.txt"
python3 bench/vecmath.py --stride 1048573 --dense 0 --block 32 128 384 --runs 30 > "$OUT/vecmath_xeon.txt" 2>&1
echo "rc=$?" >> "$OUT/vecmath_xeon.txt"
