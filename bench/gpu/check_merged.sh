#!/usr/bin/env bash
# One device call after merging several GPU changes: the GPU test files first (correctness of what ships on by
# default), then BERT-base B=1 S=128 (fp32 / TF32 / fp16, row-chain A/B, torch.compile beside it), then the
# ResNet-50 fp16 convolution A/B of the options that ship off (shared output tile, tap-major order), each step
# under its own time limit so that the call returns within the device's 10 minutes. Run from the repository root
# with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
set -u
. "$(dirname "$0")/device_setup.sh"
timeout ${BERT_S:-170} python3 bench/gpu/tensor_cores.py --out "$OUT/bert" --parts bert --jobs 12 \
    --bert-variants ${BERT_VARIANTS:-fp32 tf32 fp16 fp32_new fp32_old fp16_new fp16_old} > "$OUT/bert.log" 2>&1
echo "bert rc=$?" >> "$OUT/bert.log"
timeout ${CONV_S:-150} python3 bench/gpu/tensor_cores.py --out "$OUT/resnet" --parts resnet --batches 1 32 \
    --resnet-modes ${RESNET_MODES:-fp16 fp16_staged fp16_tap fp16_staged_tap} --iters 50 --jobs 12 --ref-max-batch 32 > "$OUT/resnet.log" 2>&1
echo "resnet rc=$?" >> "$OUT/resnet.log"
