#!/usr/bin/env bash
# Issue 20 (GPU BERT-base): BERT-base B=1 S=128 on the
# H200 (headline fp32 / TF32 / fp16 through Pipeline.compile, the row-chain A/B through compile_bundle, and
# torch.compile reduce-overhead beside it), then the GPU tests of the row-chain and matmul kernels. Run from the repository root with PYTHONPATH set; writes under $OUT.
set -u
OUT=${OUT:-bench/gpu/results}
mkdir -p "$OUT"
export CUVIL_CACHE_DIR=/tmp/cuvil-cache
python3 bench/gpu/tensor_cores.py --out "$OUT" --parts bert --jobs 12 \
    --bert-variants fp32 tf32 fp16 ${AB:-fp32_new fp32_old fp16_new fp16_old} > "$OUT/bert.log" 2>&1
echo "bench rc=$?" >> "$OUT/bert.log"
NX=""; python3 -c "import xdist" 2>/dev/null && NX="-n 6"
timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider $NX tests/test_gpu_row_chain.py tests/test_gpu_scaled_operands.py tests/test_gpu_matmul_simt.py \
    tests/test_gpu_tensor_cores.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.txt"
