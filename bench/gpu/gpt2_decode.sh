#!/usr/bin/env bash
# One device call for issue 20's GPU decode figure: the device record (device_setup.sh; SKIP_GPU_TESTS=1 skips the
# GPU test files when the branch changes no src/), then bench/gpu/gpt2_decode.py (GPT-2 124M decode step, past 128
# and 1023, Cuvil's bundle beside torch.compile reduce-overhead, outputs checked against onnxruntime) under
# ${DECODE_S:-270} s. Run from the repository root with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
set -u
. "$(dirname "$0")/device_setup.sh"
timeout ${DECODE_S:-270} python3 bench/gpu/gpt2_decode.py --out "$OUT" --budget ${BUDGET_S:-230} \
    --variants ${VARIANTS:-fp32 fp16 tf32} --iters ${ITERS:-300} --jobs 6 > "$OUT/gpt2_decode.log" 2>&1
echo "gpt2_decode rc=$?" >> "$OUT/gpt2_decode.log"
tail -40 "$OUT/gpt2_decode.log"
