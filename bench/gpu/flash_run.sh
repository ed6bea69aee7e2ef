#!/usr/bin/env bash
# One device call (session 39, issues 20 / 22): float16 attention of many query rows on tensor cores
# (PtxTuning.attention_mma, ptx/attention_mma.py). The GPU tests of attention and of the tensor-core products
# first (device_setup.sh), then BERT-base (12 layers) at B = 1, S = 128 and at the (B, S) points in ${POINTS}
# through tensor_cores.py: the flash kernel ("fp16") against the scores / softmax / P.V kernels
# ("fp16_noflash"), torch.compile (reduce-overhead) beside them in the same process, then every kernel's time by
# stage (bert_kernels.py); ${BERT_EXTRA} goes to tensor_cores.py as well (streams_run.sh: --streams 4). Run from
# the repository root with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
set -u
OUT=${OUT:-bench/gpu/results}
TESTS=${TESTS:-"tests/test_gpu_attention.py tests/test_gpu_tensor_cores.py tests/test_gpu_matmul_splitk.py"}
TEST_S=${TEST_S:-200}
export TESTS TEST_S OUT
source bench/gpu/device_setup.sh
for pt in ${POINTS:-1x128 8x128}; do
    b=${pt%x*}; s=${pt#*x}
    timeout ${BERT_S:-170} python3 bench/gpu/tensor_cores.py --out "$OUT/bert_b${b}_s${s}" --parts bert --jobs 14 \
        --bert-batch "$b" --seq "$s" --iters ${ITERS:-100} --bert-variants ${BERT_VARIANTS:-fp16 fp16_noflash} ${BERT_EXTRA:-} \
        > "$OUT/bert_b${b}_s${s}.log" 2>&1
    echo "bert rc=$?" >> "$OUT/bert_b${b}_s${s}.log"
    grep -E "p50|rc=|rror" "$OUT/bert_b${b}_s${s}.log" | cut -c1-260
    python3 bench/gpu/bert_kernels.py "$OUT/bert_b${b}_s${s}/tensor_cores.json" > "$OUT/bert_kernels_b${b}_s${s}.txt" 2>&1
done
