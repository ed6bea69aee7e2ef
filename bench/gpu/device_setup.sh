# Sourced by the one-call device scripts (check_merged.sh, row_chain_ab.sh, ...): sets OUT (default
# bench/gpu/results) and the compile cache, records the GPU, driver and host CPU in $OUT/device.txt, then runs the
# GPU test files (or those in ${TESTS}) (xdist with 8 workers where installed) under ${TEST_S:-200} s into $OUT/pytest_gpu.txt, so that a
# call's figures always come with the correctness of the code they measure (SKIP_GPU_TESTS=1: not run, for a call
# whose branch changes no src/ and checks its own outputs). Run from the repository root with PYTHONPATH set.
OUT=${OUT:-bench/gpu/results}
mkdir -p "$OUT"
export CUVIL_CACHE_DIR=/tmp/cuvil-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
# the packages the device image lacks (stage their cp312 wheels and put them on PYTHONPATH): stop before any test
# or figure when one is missing or too old (session 19: without cyclonedx every compile failed; z3 4.15 left the
# tensor-core convolutions unproved, hence guarded)
python3 - >> "$OUT/device.txt" 2>&1 <<'PY' || { tail -1 "$OUT/device.txt"; exit 3; }
import importlib.metadata as md
import importlib.util
modules = {"z3-solver": "z3", "lark": "lark", "cyclonedx-python-lib": "cyclonedx"}
missing = [dist for dist, mod in modules.items() if importlib.util.find_spec(mod) is None]
if missing:
    raise SystemExit(f"device_setup: missing {', '.join(missing)}: stage their wheels (pip download --python-version "
                     "3.12 --only-binary=:all:) and add the install directory to PYTHONPATH")
if int(md.version("z3-solver").split(".")[0]) < 5:
    raise SystemExit(f"device_setup: z3-solver {md.version('z3-solver')} < 5.0 (setup.cfg's floor): stage a newer wheel")
print("packages: z3-solver", md.version("z3-solver"), "lark", md.version("lark"), "cyclonedx-python-lib",
      md.version("cyclonedx-python-lib"))
PY
python3 -c "from cuvil.targets.x86.cpu import cpu_label; print(cpu_label())" >> "$OUT/device.txt" 2>&1
if [ -z "${SKIP_GPU_TESTS:-}" ]; then
    NX=""; python3 -c "import xdist" 2>/dev/null && NX="-n 8"
    timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider $NX -rxXs ${TESTS:-tests/test_gpu_*.py} > "$OUT/pytest_gpu.txt" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
    tail -3 "$OUT/pytest_gpu.txt"
fi
