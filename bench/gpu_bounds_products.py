"""The build-time cost of stating the GPU product kernels' accesses to the bounds prover (bounds_patterns.py:
GpuPatterns.matmul_accesses / simt_accesses / gemv_accesses, refute_products), side by side in one process:
the proof of a BERT-base-sized encoder block's GPU stages with the products stated ("stated") and without
("unstated": the hook sees only the convolution families, no product pre-pass, as before session 16),
interleaved blocks, a fresh prover (no proof cache) per run, median wall and thread CPU time.

    PYTHONPATH=src python bench/gpu_bounds_products.py [--reps 5]
"""
import argparse
import os
import statistics
import time

import attrs

from cuvil import Pipeline
from cuvil.kernels.bounds import _FAMILIES
from cuvil.targets.ptx import bounds_patterns as bp
from cuvil.targets.ptx import codegen as cg
from cuvil.targets.ptx.codegen import PtxKernelModule, build_ptx, gpu_schedule, target_machine
from cuvil.testing.models import transformer_block


def prove(sched, mode, stated):
    """(wall s, thread CPU s, certificate) of prove_gpu_stages over the stages build_ptx would emit."""
    stages = [attrs.evolve(st) for st in sched.stages]
    stages, _ = cg.rewrite_stages(stages, cg.select_kernel_rules(None, fma=True))   # as build_ptx: fma reductions
    km = PtxKernelModule("b", target_machine(), scratch_offset=sched.arena_bytes, allow_tf32=mode == "tf32",
                         fma=True)
    ops, refute = bp.GpuPatterns.ops, bp.refute_products
    if not stated:
        bp.GpuPatterns.ops, bp.refute_products = _FAMILIES, lambda *a: False
    try:
        w, c = time.perf_counter(), time.thread_time()
        cert = bp.prove_gpu_stages(sched, stages, km)
        return time.perf_counter() - w, time.thread_time() - c, cert
    finally:
        bp.GpuPatterns.ops, bp.refute_products = ops, refute


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    from cuvil.targets.x86.cpu import cpu_label
    print(f"CPU: {cpu_label()}; load average {os.getloadavg()}")
    g = Pipeline.from_onnx(transformer_block(d_model=768, heads=12, d_ff=3072, batch=1, seq=128)).optimize().graph
    for mode in ("tf32", "fp32"):
        sched = gpu_schedule(g)
        # the stages as build_ptx proves them (after its kernel rules: fma reductions take the tensor cores)
        r = build_ptx(sched, "sm_90", fma=True, allow_tf32=mode == "tf32")
        kinds = sorted({k.kind for k in r.kernels if k.kind.startswith(("matmul", "gemm", "gemv"))})
        cert = r.memory_safety
        print(f"{mode}: product kernels {kinds}; certificate {cert.summary()}, {sum(k.accesses for k in cert.kernels)}"
              f" accesses, guarded {[k.stage for k in cert.guarded]}")
        times = {True: [], False: []}
        for _ in range(args.reps):
            for stated in (False, True):
                w, c, _ = prove(sched, mode, stated)
                times[stated].append((w, c))
        for stated in (False, True):
            ws, cs = zip(*times[stated])
            print(f"  {'stated' if stated else 'unstated'}: median wall {statistics.median(ws):.3f} s, "
                  f"thread CPU {statistics.median(cs):.3f} s")
        ratio = statistics.median(w for w, _ in times[True]) / statistics.median(w for w, _ in times[False])
        print(f"  stated / unstated wall: {ratio:.2f}")


if __name__ == "__main__":
    main()
