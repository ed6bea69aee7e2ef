#!/usr/bin/env bash
# One device call (session 40, issues 20 / 22): kernels that share no bytes run at once (a bundle's CUDA graph
# captured over several streams, load_bundle(streams=N), ptx/launch_deps.py) and the GPU attention kernels storing
# their rows where the heads' merge puts them (PtxTuning.attention_heads_merged). flash_run.sh with these tests
# (device_setup.sh: the streams' bit-for-bit checks, attention, bundles, sessions) and BERT-base fp16 (12 layers) at
# the (B, S) points in ${POINTS}: "fp16" as shipped, "fp16_heads" with attention_heads_merged, each bundle timed
# over 1 stream (the default) and over 4 (--streams 4), torch.compile (reduce-overhead) beside them, every
# kernel's time by stage; then bench/gpu/streams.py over ${MODELS} (SKIP_ZOO=1: not). Run from the repository root
# with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
set -u
OUT=${OUT:-bench/gpu/results}
TESTS=${TESTS:-"tests/test_gpu_streams.py tests/test_gpu_attention.py tests/test_gpu_bundle.py tests/test_gpu_sessions.py"} \
    TEST_S=${TEST_S:-240} POINTS=${POINTS:-1x128} BERT_VARIANTS=${BERT_VARIANTS:-fp16 fp16_heads} \
    BERT_EXTRA="--streams 4" OUT="$OUT" bash bench/gpu/flash_run.sh
if [ -z "${SKIP_ZOO:-}" ]; then
    timeout ${ZOO_S:-200} python3 bench/gpu/streams.py --out "$OUT/streams.json" --models ${MODELS:-inception_v1,resnet50} \
        > "$OUT/streams.log" 2>&1
    echo "streams rc=$?" >> "$OUT/streams.log"
    tail -8 "$OUT/streams.log" | cut -c1-300
fi
