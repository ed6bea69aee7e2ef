#!/usr/bin/env bash
# bench/run_all.py on the device host's CPU (an Intel Xeon of 16 cores beside the H200), pinned to two cores
# with taskset so its 1- and 2-thread figures compare with the 2-core VMs of bench/RESULTS.md: the five CNNs
# and the transformers (BERT-base, GPT-2 decode), Cuvil beside onnxruntime (and OpenVINO when importable).
# The transformers are exported there by torch.onnx (torch and transformers are installed on that host;
# bench/models/export_transformers.py, TorchScript exporter) unless NO_EXPORT=1 (then built by
# cuvil.testing.hf_models; EXPORT="bert" exports BERT only). The report and log go to $OUT (the device's result folder), else bench/results/.
#
# Through the `run` tool, from the repo root, carrying .whl (z3-solver and lark wheels for cp312: the host's
# python lacks them):
#   python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl;
#   export PYTHONPATH=/tmp/site:$PWD/src; bash bench/device_cpu.sh                    # everything (~25 min)
#   ...; EXPORT=bert bash bench/device_cpu.sh --models squeezenet --seqs 32 --transformers bert   # a quick check
# The `run` tool sends the session's checkout (/work/main), not a helper's worktree: run this from main once
# merged, with .whl there. OpenVINO cannot travel too: its cp312 wheel (59 MB) and z3's (39 MB) together pass
# the 64 MiB a call carries, so the device report has no OpenVINO column unless the host gains openvino.
# Extra arguments go to run_all.py. CORES (default 1-2) picks the cores, PYTHON the interpreter (python3).
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-bench/results}
CORES=${CORES:-1-2}
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-$PWD/src}
case ":$PYTHONPATH:" in *":$PWD/src:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$PWD/src" ;; esac
export CUVIL_CACHE_DIR=${CUVIL_CACHE_DIR:-/tmp/cuvil-cache-device}
export PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR"
label=$("$PY" -c "from cuvil.targets.x86.cpu import cpu_label; print(cpu_label())")
day=$(date -u +%Y-%m-%d)
slug=$(echo "$label" | tr 'A-Z' 'a-z' | sed 's/[^a-z0-9]\{1,\}/-/g; s/^-//; s/-$//')
report="$OUTDIR/run_all-$day-$slug.md"
models=()
EXPORT=${EXPORT:-bert gpt2_decode}   # the models to export (EXPORT=bert: BERT only)
if [ "${NO_EXPORT:-0}" != 1 ] && "$PY" -c "import torch, transformers" 2>/dev/null; then
  exp=/tmp/cuvil-bench-exports
  # the export runs on every core; only the timed runs are pinned
  if "$PY" bench/models/export_transformers.py --out "$exp" --exporter torchscript --only $EXPORT 2>&1 \
      | tee "$OUTDIR/export.log"; test "${PIPESTATUS[0]}" = 0; then
    for m in $EXPORT; do
      case $m in bert) models+=(--bert-model "$exp/bert.torchscript.onnx") ;;
                 gpt2_decode) models+=(--gpt2-model "$exp/gpt2_decode.torchscript.onnx") ;; esac
    done
  else
    echo "export failed (see export.log): the transformers are built by cuvil.testing.hf_models instead"
  fi
fi
echo "$label; pinned to cores $CORES of $(nproc); report: $report"
set +e
taskset -c "$CORES" "$PY" bench/run_all.py --out "$report" "${models[@]}" \
  --note "the device host ($label, $(nproc) cores beside an H200), run_all pinned to cores $CORES with taskset" \
  "$@" 2>&1 | tee "$OUTDIR/run_all-$day-$slug.log"
rc=${PIPESTATUS[0]}
echo "run_all.py exit code $rc; report: $report"
exit "$rc"
