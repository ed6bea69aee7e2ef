#!/usr/bin/env bash
# One device call after merging several GPU changes: the GPU test files first (correctness of what ships on by
# default), then BERT-base B=1 S=128 (fp32 / TF32 / fp16, row-chain A/B, torch.compile beside it), then the
# ResNet-50 fp16 convolution A/B of the options that ship off (shared output tile, tap-major order), each step
# under its own time limit so that the call returns within the device's 10 minutes. Run from the repository root
# with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}. GPT2_S / REAL_S (seconds, default 0: skipped) add
# the GPT-2 decode step and the real exports; BERT_S / CONV_S = 0 skip those steps.
set -u
. "$(dirname "$0")/device_setup.sh"
if [ "${BERT_S:-170}" -gt 0 ]; then
    timeout ${BERT_S:-170} python3 bench/gpu/tensor_cores.py --out "$OUT/bert" --parts bert --jobs 12 \
        --bert-variants ${BERT_VARIANTS:-fp32 tf32 fp16 fp32_new fp32_old fp16_new fp16_old} > "$OUT/bert.log" 2>&1
    echo "bert rc=$?" >> "$OUT/bert.log"
fi
if [ "${CONV_S:-150}" -gt 0 ]; then
    timeout ${CONV_S:-150} python3 bench/gpu/tensor_cores.py --out "$OUT/resnet" --parts resnet --batches 1 32 \
        --resnet-modes ${RESNET_MODES:-fp16 fp16_staged fp16_tap fp16_staged_tap} --iters 50 --jobs 12 --ref-max-batch 32 > "$OUT/resnet.log" 2>&1
    echo "resnet rc=$?" >> "$OUT/resnet.log"
fi
# the GPT-2 124M decode step (torch.compile beside the base variants) and the torch.onnx exports of
# tests/fixtures/exports against onnxruntime, each skipped at 0 s
if [ "${GPT2_S:-0}" -gt 0 ]; then
    timeout ${GPT2_S} python3 bench/gpu/gpt2_decode.py --out "$OUT/gpt2" --budget $(( GPT2_S - 25 )) \
        --variants ${GPT2_VARIANTS:-fp32 fp16} --iters ${ITERS:-200} --rounds ${GPT2_ROUNDS:-0} --jobs 12 > "$OUT/gpt2.log" 2>&1
    echo "gpt2_decode rc=$?" >> "$OUT/gpt2.log"
fi
if [ "${REAL_S:-0}" -gt 0 ]; then
    timeout ${REAL_S} python3 bench/gpu/real_exports.py --targets gpu --json "$OUT/real_exports.json" > "$OUT/real_exports.log" 2>&1
    echo "real_exports rc=$?" >> "$OUT/real_exports.log"
fi
