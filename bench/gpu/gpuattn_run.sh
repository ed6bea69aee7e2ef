#!/usr/bin/env bash
# One device call for ptx/attention.py (PtxTuning.fused_attention, issue 20): the device record and the GPU test file
# of the fused kernel (tests/test_gpu_attention.py, under ${TEST_S:-80} s), then the GPT-2 124M decode step with the
# option off and on (bench/gpu/gpt2_decode.py: ${DECODE_VARIANTS:-fp32 fp32_attn fp16 fp16_noattn}, past 128 and 1023,
# torch.compile beside the base variants) under ${DECODE_S:-170} s, then BERT-base B=1 S=128 off and on
# (bench/gpu/tensor_cores.py --parts bert, Cuvil only) under ${BERT_S:-70} s. Run from the repository root with
# PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
set -u
TEST_S=${TEST_S:-80} TESTS=${TESTS:-tests/test_gpu_attention.py} . "$(dirname "$0")/device_setup.sh"
timeout ${DECODE_S:-170} python3 bench/gpu/gpt2_decode.py --out "$OUT" --budget $(( ${DECODE_S:-170} - 25 )) \
    --variants ${DECODE_VARIANTS:-fp32 fp32_attn fp16 fp16_noattn} --iters ${ITERS:-200} --jobs 8 > "$OUT/gpt2_decode.log" 2>&1
echo "gpt2_decode rc=$?" >> "$OUT/gpt2_decode.log"
grep -E "graph p50|p50|ratio|cuvil /|attention|error" "$OUT/gpt2_decode.log" | tail -40
if [ "${BERT_S:-70}" -gt 0 ]; then
    timeout ${BERT_S:-70} python3 bench/gpu/tensor_cores.py --out "$OUT" --parts bert --no-torch --iters 100 \
        --bert-variants ${BERT_VARIANTS:-fp16_noattn fp16_attn fp32_noattn fp32_attn} --jobs 8 > "$OUT/bert.log" 2>&1
    echo "bert rc=$?" >> "$OUT/bert.log"
    grep -E "cuvil|rc=" "$OUT/bert.log" | tail -12
fi
