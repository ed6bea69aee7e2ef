#!/usr/bin/env bash
# One device call (session 15, issue 20): the GPU test files at the branch's defaults (row chains on), then
# BERT-base B=1 S=128 with the row-chain kernels on and off in fp32 / TF32 / fp16 (compile_bundle on the same
# graph), the tensor-core product plans' A/B (_mb96, _ks8) and the headline variants through Pipeline.compile,
# torch.compile beside them; then every kernel's time by stage (bert_kernels.py). Run from the repository root
# with PYTHONPATH set; writes under ${OUT:-bench/gpu/results}.
set -u
. "$(dirname "$0")/device_setup.sh"
timeout ${BERT_S:-300} python3 bench/gpu/tensor_cores.py --out "$OUT/bert" --parts bert --jobs 14 \
    --bert-variants ${BERT_VARIANTS:-fp32_rows fp32_norows tf32_rows tf32_norows fp16_rows fp16_norows \
    tf32_rows_mb96 fp16_rows_mb96 fp16_rows_ks8 fp32 tf32 fp16} > "$OUT/bert.log" 2>&1
echo "bert rc=$?" >> "$OUT/bert.log"
grep -E "p50|rc=" "$OUT/bert.log" | cut -c1-220
python3 bench/gpu/bert_kernels.py "$OUT/bert/tensor_cores.json" > "$OUT/bert_kernels.txt" 2>&1
