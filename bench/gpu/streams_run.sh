#!/usr/bin/env bash
# One device call (session 40, issues 20 / 22): kernels that share no bytes run at once (a bundle's CUDA graph
# captured over several streams, load_bundle(streams=N), ptx/launch_deps.py) and the GPU attention kernels storing
# their rows where the heads' merge puts them (no copy kernel). The GPU tests first (device_setup.sh: the streams'
# bit-for-bit checks, attention, bundles, sessions), then BERT-base fp16 (12 layers) at the (B, S) points in
# ${POINTS} through tensor_cores.py ("fp16" as shipped, "fp16_heads" with PtxTuning.attention_heads_merged), each
# bundle timed over 1 stream (the default) and over 4 (--streams 4),
# torch.compile (reduce-overhead) beside them in the same process, every kernel's time by stage (bert_kernels.py);
# then bench/gpu/streams.py over ${MODELS} (SKIP_ZOO=1: not). Run from the repository root with PYTHONPATH set;
# writes under ${OUT:-bench/gpu/results}.
set -u
OUT=${OUT:-bench/gpu/results}
TESTS=${TESTS:-"tests/test_gpu_streams.py tests/test_gpu_attention.py tests/test_gpu_bundle.py tests/test_gpu_sessions.py"}
TEST_S=${TEST_S:-240}
export TESTS TEST_S OUT
source bench/gpu/device_setup.sh
for pt in ${POINTS:-1x128}; do
    b=${pt%x*}; s=${pt#*x}
    timeout ${BERT_S:-200} python3 bench/gpu/tensor_cores.py --out "$OUT/bert_b${b}_s${s}" --parts bert --jobs 14 \
        --bert-batch "$b" --seq "$s" --iters ${ITERS:-100} --bert-variants ${BERT_VARIANTS:-fp16 fp16_heads} --streams 4 \
        > "$OUT/bert_b${b}_s${s}.log" 2>&1
    echo "bert rc=$?" >> "$OUT/bert_b${b}_s${s}.log"
    grep -E "p50|rc=|rror" "$OUT/bert_b${b}_s${s}.log" | cut -c1-260
    python3 bench/gpu/bert_kernels.py "$OUT/bert_b${b}_s${s}/tensor_cores.json" > "$OUT/bert_kernels_b${b}_s${s}.txt" 2>&1
done
if [ -z "${SKIP_ZOO:-}" ]; then
    timeout ${ZOO_S:-200} python3 bench/gpu/streams.py --out "$OUT/streams.json" --models ${MODELS:-inception_v1,resnet50} \
        > "$OUT/streams.log" 2>&1
    echo "streams rc=$?" >> "$OUT/streams.log"
    tail -8 "$OUT/streams.log" | cut -c1-300
fi
