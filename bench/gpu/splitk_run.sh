#!/usr/bin/env bash
# One device call (session 16, issue 20): split-K tensor-core products (PtxTuning.mma_sm_groups). The new GPU
# test file and the tensor-core / SIMT / row-chain GPU tests first, then BERT-base B=1 S=128 through
# compile_bundle: the former products ("_g0"; session 16 ran them as "_rows", then the default) against "_gN" (N
# groups per SM, split-K) and "_vec"
# (16-byte float16 operand loads) variants,
# torch.compile (reduce-overhead) beside them, then every kernel's time by stage. Run from the repository
# root with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
set -u
OUT=${OUT:-bench/gpu/results}
mkdir -p "$OUT"
export CUVIL_CACHE_DIR=/tmp/cuvil-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
python3 -c "from cuvil.targets.x86.cpu import cpu_label; print(cpu_label())" >> "$OUT/device.txt" 2>&1
NX=""; python3 -c "import xdist" 2>/dev/null && NX="-n 8"
timeout ${TEST_S:-110} python3 -m pytest -q -p no:cacheprovider $NX -rxXs tests/test_gpu_matmul_splitk.py \
    tests/test_gpu_tensor_cores.py tests/test_gpu_matmul_simt.py tests/test_gpu_row_chain.py \
    tests/test_gpu_scaled_operands.py > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
tail -3 "$OUT/pytest_gpu.txt"
timeout ${BERT_S:-170} python3 bench/gpu/tensor_cores.py --out "$OUT/bert" --parts bert --jobs 14 \
    --bert-variants ${BERT_VARIANTS:-fp16_g0 fp16_vec fp16_g4 fp16_g8 fp16_g4_vec fp16_g8_vec fp16_g16_vec tf32_g0 tf32_g4 tf32_g8} \
    > "$OUT/bert.log" 2>&1
echo "bert rc=$?" >> "$OUT/bert.log"
grep -E "p50|rc=|rror" "$OUT/bert.log" | cut -c1-220
python3 bench/gpu/bert_kernels.py "$OUT/bert/tensor_cores.json" > "$OUT/bert_kernels.txt" 2>&1
