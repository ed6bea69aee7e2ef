#!/usr/bin/env bash
# The cp.async pointwise convolutions (ptx/conv_mma.py, issues 21/22) on a GPU machine, in one call: ResNet-50
# fp16 at batch 1 and 32 with and without them (A/B "fp16_noasync"), beside torch.compile fp16, every kernel
# timed, outputs against onnxruntime float32 (CPU) at both batches; then the GPU tests of the convolution
# kernels. Run from the repository root with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
# Per-kernel TFLOP/s afterwards (no GPU needed): python3 bench/gpu/conv_kernel_flops.py OUT/tensor_cores.json
set -u
OUT=${OUT:-bench/gpu/results}
mkdir -p "$OUT"
export CUVIL_CACHE_DIR=/tmp/cuvil-cache
BATCHES=${BATCHES:-"1 32"}
MODES=${MODES:-"fp16 fp16_noasync fp16_staged fp16_tap fp16_staged_tap tf32 tf32_tap"}
python3 bench/gpu/tensor_cores.py --out "$OUT" --parts resnet --batches $BATCHES --resnet-modes $MODES \
    --iters 50 --jobs 12 --ref-max-batch 32 > "$OUT/tensor_cores.log" 2>&1
echo "tensor_cores rc=$?" >> "$OUT/tensor_cores.log"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_conv_mma.py > "$OUT/pytest_conv_mma.txt" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_conv_mma.txt"
