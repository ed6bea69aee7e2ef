#!/usr/bin/env bash
# One device call (session 17, issues 20/22/21): float16 tensor-core products through cp.async stages and ldmatrix
# (PtxTuning.mma_async). The GPU tests of the touched files first, then BERT-base B=1 S=128 (fp32, tf32, fp16 =
# the register-staged products, fp16_asyncN = N cp.async stages) and ResNet-50 fp16 at batch 1 and 32 (its final
# Gemm is its one product: fp16 against fp16_async3) through compile_bundle, torch.compile (reduce-overhead)
# beside them, then every kernel's time by stage. Run from the repository root with PYTHONPATH set; writes under
# ${OUT:-bench/gpu/results}. TEST_S / BENCH_S: time limits of the two parts; TEST_FILES, BERT_VARIANTS, RESNET_MODES
# replace the lists below (the second call: BERT_VARIANTS="fp32 tf32 fp16 fp16_sync" RESNET_MODES=fp16, fp16 being
# the new default, mma_async=3).
set -u
OUT=${OUT:-bench/gpu/results}
mkdir -p "$OUT"
export CUVIL_CACHE_DIR=/tmp/cuvil-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
python3 -c "from cuvil.targets.x86.cpu import cpu_label; print(cpu_label())" >> "$OUT/device.txt" 2>&1
NX=""; python3 -c "import xdist" 2>/dev/null && NX="-n 8"
timeout ${TEST_S:-100} python3 -m pytest -q -p no:cacheprovider $NX -rxXs ${TEST_FILES:-tests/test_gpu_matmul_async.py \
    tests/test_gpu_matmul_splitk.py tests/test_gpu_tensor_cores.py} > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
grep -E "passed|failed|Error|assert" "$OUT/pytest_gpu.txt" | tail -12
timeout ${BENCH_S:-200} python3 bench/gpu/tensor_cores.py --out "$OUT/bench" --parts bert resnet --jobs 15 \
    --bert-variants ${BERT_VARIANTS:-fp32 tf32 fp16 fp16_async2 fp16_async3 fp16_async4 fp16_g0_async3} \
    --batches 1 32 --resnet-modes ${RESNET_MODES:-fp16 fp16_async3} > "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
grep -E "p50|rc=|rror" "$OUT/bench.log" | cut -c1-200
python3 bench/gpu/bert_kernels.py "$OUT/bench/tensor_cores.json" > "$OUT/bert_kernels.txt" 2>&1
