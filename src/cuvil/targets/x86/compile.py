"""Graph -> ``libNAME.so`` + ``libNAME.h`` + ``libNAME.manifest.json``.

Steps: schedule (fusion + memory plan) -> LLVM kernels (llvmlite, object file for the host CPU or
``cpu``) -> weights packed into one aligned blob embedded with ``.incbin`` -> the model descriptor (C) ->
``cc`` links them with the C runtime. The result depends on libc, libm and libpthread only.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Callable, Optional


from ...errors import CuvilError
from ...ir.graph import Graph
from ..schedule import schedule
from .codegen import generate_object, host_target, vector_bits
from .gemm import tile_cols
from .header import generate_header
from .link import check_dependencies, link_shared, unexpected_dependencies
from .model_c import generate_model_c
from .model_info import IODesc, ModelInfo, StepDesc


def compile_x86(g: Graph, out_so: str, *, opt_level: int = 3, cpu: Optional[str] = None, prefix: str = "cuvil",
                manifest_extra: Optional[dict] = None, progress: Optional[Callable[[str], None]] = None) -> dict:
    """Compile ``g`` (static shapes) into ``out_so``; writes the header and manifest beside it and returns
    the manifest."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    out_so = os.path.abspath(out_so)
    base = os.path.splitext(out_so)[0]
    say(f"scheduling {len(g.nodes)} nodes")
    _, _, cpu_name, features = host_target(cpu, opt_level)
    sched = schedule(g, gemm_cols=tile_cols(vector_bits(cpu_name, features)), split_concat=True)
    say(f"{len(sched.stages)} kernels, arena {sched.arena_bytes} B, weights {sched.weights_bytes} B; generating LLVM IR")
    obj, steps, target = generate_object(sched, prefix, cpu, opt_level)
    t_codegen = time.perf_counter()
    weights_sym = f"{prefix}_weights" if sched.weights_bytes else None
    info = ModelInfo(
        inputs=[IODesc(b.name, int(b.dtype), b.shape) for b in sched.inputs],
        outputs=[IODesc(b.name, int(b.dtype), b.shape) for b in sched.outputs],
        arena_bytes=sched.arena_bytes,
        steps=[StepDesc(sym, extent, grain) for sym, extent, grain in steps],
        weights_symbol=weights_sym, prefix=prefix, scratch_bytes=target["scratch_bytes"])
    with tempfile.TemporaryDirectory(prefix="cuvil-build-") as tmp:
        kobj = os.path.join(tmp, "kernels.o")
        with open(kobj, "wb") as f:
            f.write(obj)
        weights_S = None
        if weights_sym:
            wbin = os.path.join(tmp, "weights.bin")
            with open(wbin, "wb") as f:
                f.write(sched.weights_blob())
            weights_S = (f'\t.section .rodata.{weights_sym},"a",@progbits\n\t.balign 64\n\t.globl {weights_sym}\n'
                         f'\t.hidden {weights_sym}\n\t.type {weights_sym}, @object\n{weights_sym}:\n'
                         f'\t.incbin "{wbin}"\n\t.size {weights_sym}, {sched.weights_bytes}\n'
                         '\t.section .note.GNU-stack,"",@progbits\n')
        say("linking")
        link_shared(out_so, [kobj], generate_model_c(info), weights_S, prefix)
    deps = check_dependencies(out_so)
    bad = unexpected_dependencies(deps)
    if bad:
        raise CuvilError(f"{out_so} depends on {bad}; only libc, libm and libpthread are allowed")
    with open(base + ".h", "w") as f:
        f.write(generate_header(info, prefix))
    manifest = {
        "cuvil_version": __import__("cuvil").__version__,
        "prefix": prefix,
        "target": {"triple": target["triple"], "cpu": target["cpu"], "features": target["features"]},
        "opt_level": opt_level,
        "inputs": [{"name": d.name, "dtype": d.dtype, "shape": list(d.shape)} for d in info.inputs],
        "outputs": [{"name": d.name, "dtype": d.dtype, "shape": list(d.shape)} for d in info.outputs],
        "arena_bytes": sched.arena_bytes,
        "scratch_bytes_per_thread": target["scratch_bytes"],
        "weights_bytes": sched.weights_bytes,
        "kernels": len(sched.stages),
        "fused_ops": sched.fused,
        "steps": [{"stage": st.name, "op": st.op, "shape": list(st.buf.shape), "flops": st.flops,
                   "kernel": ("gemm" if sym in target["gemm_symbols"] else
                              {"conv": "dwconv", "max": "maxpool"}.get(target["window_kinds"].get(sym), "loop"))}
                  for st, (sym, _, _) in zip(sched.stages, steps)],
        "dependencies": deps,
        "compile_seconds": round(time.perf_counter() - t0, 3),
        "codegen_seconds": round(t_codegen - t0, 3),
        **(manifest_extra or {}),
    }
    with open(base + ".manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest
