#!/usr/bin/env bash
# Everything GPU-side in one go, for one call on a lent GPU machine: environment, the GPU tests, launch
# overhead, ResNet-50 (float32 and float16), the register pass (regpass), correctness, shape profiles (profiles),
# sessions from several threads (concurrency), BERT-base from one bundle (bert_profile), the U-Net (unet), the GPT-2 decode step (gpt2_decode). Logs and JSON go to $OUT (default ./gpu-results). Each step has its own
# time limit so that one slow step leaves the others their time; all five together can outlast a 10-minute
# call, so choose steps per call: run_all.sh env pytest launch correctness, then run_all.sh resnet50
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${*:-env pytest launch resnet50 correctness}
for step in $STEPS; do
  echo "=== $step ($(date -u +%H:%M:%S))"
  case $step in
    env)
      { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv;
        python3 -c "import sys, cuda.bindings, numpy, onnx, onnxruntime, llvmlite; print(sys.version.split()[0], 'cuda-bindings', cuda.bindings.__version__, 'numpy', numpy.__version__, 'onnx', onnx.__version__, 'onnxruntime', onnxruntime.__version__, 'llvmlite', llvmlite.__version__)";
        command -v ptxas || ls /usr/local/cuda/bin/ptxas; ptxas --version 2>/dev/null | tail -1 || /usr/local/cuda/bin/ptxas --version | tail -1;
        python3 -c "from cuvil.targets.ptx import find_libdevice, find_ptxas; print('libdevice', find_libdevice(), 'ptxas', find_ptxas())"; } 2>&1 | tee "$OUT/env.txt" ;;
    pytest)
      timeout 90 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/test_gpu_bundle.py 2>&1 | tee "$OUT/pytest.txt" ;;
    launch)
      timeout 60 python3 bench/gpu/launch_overhead.py --json "$OUT/launch.json" 2>&1 | tee "$OUT/launch.txt" ;;
    resnet50)
      timeout 400 python3 bench/gpu/resnet50.py --fp16 --json "$OUT/resnet50.json" 2>&1 | tee "$OUT/resnet50.txt" ;;
    regpass)
      timeout 300 python3 bench/gpu/register_pass.py --json "$OUT/register_pass.json" 2>&1 | tee "$OUT/register_pass.txt" ;;
    profiles)
      # issue 22: one bundle for ResNet-50 batch 1..64 beside torch.compile, random-shape runs, GPU fault tests
      timeout 100 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/test_gpu_profiles.py 2>&1 | tee "$OUT/profiles_pytest.txt"
      timeout 330 python3 bench/gpu/profiles.py --budget 280 --json "$OUT/profiles.json" 2>&1 | tee "$OUT/profiles.txt" ;;
    concurrency)
      # issue 22 part 4: sessions from several threads, page-locked inputs
      timeout 60 python3 -m pytest -q -p no:warnings -p no:cacheprovider tests/test_gpu_sessions.py 2>&1 | tee "$OUT/sessions_pytest.txt"
      timeout 200 python3 bench/gpu/concurrency.py --json "$OUT/concurrency.json" --calls 200 2>&1 | tee "$OUT/concurrency.txt" ;;
    bert_profile)
      timeout 400 python3 bench/gpu/bert_profile.py --json "$OUT/bert_profile.json" 2>&1 | tee "$OUT/bert_profile.txt" ;;
    unet)
      timeout 300 python3 bench/gpu/unet.py --json "$OUT/unet.json" 2>&1 | tee "$OUT/unet.txt" ;;
    gpt2_decode)
      # issue 20: GPT-2 124M decode step per token at past 128 / 1023 beside torch.compile reduce-overhead
      timeout 280 python3 bench/gpu/gpt2_decode.py --out "$OUT" --budget 230 --variants fp32 fp16 2>&1 | tee "$OUT/gpt2_decode.txt" ;;
    correctness)
      timeout 260 python3 bench/gpu/check_correctness.py --json "$OUT/correctness.json" 2>&1 | tee "$OUT/correctness.txt" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date -u +%H:%M:%S))"
