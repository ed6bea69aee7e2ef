"""The GPU artifact: a bundle directory ``NAME.cuvil/`` that any machine with a CUDA driver can run, written
on machines without one.

    NAME.cuvil/
      kernels.ptx            one module, one kernel per schedule stage (``generate_ptx``)
      kernels.<arch>.cubin   the same assembled by ptxas for ``arch`` (when ptxas was found at compile time)
      weights.bin            every constant, packed as the schedule's weights plan lays them out
      plan.json              arena bytes, the kernels in launch order (name, grid, block, n), inputs and outputs
                             (name, dtype, shape, index in the buffer-pointer table)
      manifest.json          model name, arch, Cuvil version, ptxas registers/spills per kernel, kernel rules
                             fired (name -> count), fma, float16 tensors (with --enable-fp16), the
                             memory-safety certificate (``memory_safety``, docs/memory-safety.md)

At run time ``bufs = [arena, weights, inputs..., outputs...]`` (device pointers) and kernel ``k`` is launched
as ``kernel_k<<<grid, block>>>(bufs, n)``, in plan order, on one stream (:mod:`cuvil.targets.ptx.runtime`).
Nothing here needs a GPU or cuda-python.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from typing import Mapping, Optional

from ...errors import CuvilError
from ...ir.dtype import DType
from ...ir.graph import Graph
from ...kernels.schedule import ARENA, WEIGHTS
from ...progress import stage
from ...rewrite_rules.precision import to_half
from ...rewrite_rules.proved_rewrite import applied_rules
from ...version import __version__
from .attention import attention_in_half, fuse_attention
from .archs import arch_number
from .attention_mma import MIN_SM as FLASH_MIN_SM
from .attention_mma import flash_operands_half, flash_shapes
from .codegen import TRIPLE, build_ptx, gpu_schedule
from .launch_deps import kernel_dependencies, launch_summary
from ...precision.policy import reconcile
from .conv_mma import conv_stage_precisions, narrowed_convs_run
from .matmul_mma import narrowed_nodes_run, stage_precisions, stage_scales
from .ptxas import PtxasError, assemble, find_ptxas
from .regpressure import relieve, sms_for
from .tuning import DEFAULT_TUNING, PtxTuning, product_sms

BUNDLE_SUFFIX = ".cuvil"
PLAN_FORMAT = "cuvil-gpu-plan/1"
FILES = ("kernels.ptx", "weights.bin", "plan.json", "manifest.json")
#: The bundle's SBOM and provenance (docs/supply-chain.md): fixed names inside the directory, like its other
#: files, so that a bundle saved under another name keeps them.
SBOM_FILE, PROVENANCE_FILE = "sbom.cdx.json", "provenance.intoto.json"
#: A signed bundle's signature (:mod:`cuvil.signing`; model-signing's default name): it covers every other file.
SIGNATURE_FILE = "model.sig"


def _io(bufs) -> list:
    return [{"name": b.name, "dtype": DType(b.dtype).numpy.name if DType(b.dtype).numpy is not None else None,
             "dtype_code": int(b.dtype), "shape": [int(d) for d in b.shape], "buffer": int(b.base)} for b in bufs]


def _ptxas_version(exe: str) -> Optional[str]:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln for ln in out.splitlines() if "release" in ln]
    return lines[-1].strip() if lines else None




def compile_bundle(g: Graph, out_dir: str, *, arch: str = "sm_90", opt_level: int = 3, prefix: str = "cuvil",
                   fma: bool = True, kernel_rules=None, enable_fp16: bool = False, narrow_index: bool = False,
                   register_pass: bool = False, sms: Optional[int] = None, manifest_extra: Optional[dict] = None,
                   unpadded: bool = True,
                   fused_splitk: bool = False, tuning: PtxTuning = DEFAULT_TUNING,
                   max_spill: Optional[int] = None, allow_tf32: bool = False) -> dict:
    """Compile ``g`` (static shapes) into the bundle directory ``out_dir`` (created; files in it replaced);
    returns the manifest. ptxas, where installed, assembles the PTX for ``arch``: a rejected module is an
    error, its per-kernel resource report goes into the manifest and the cubin into the bundle.

    ``fma`` (default on, as nvcc and PyTorch): the proved ``prove real`` kernel rules (fma contraction) may
    run; ``kernel_rules`` as for :func:`~cuvil.targets.ptx.codegen.build_ptx`. ``enable_fp16``: float32
    tensors are computed in float16 (:mod:`cuvil.rewrite_rules.precision`; inputs and outputs stay float32).
    ``register_pass`` (opt-in; needs ptxas): kernels that run in several waves and whose registers limit
    their blocks per SM get a ``.maxnreg`` cap that saves a wave and that ptxas meets without spilling (:mod:`cuvil.targets.ptx.regpressure`; ``sms``: the SMs of the GPU it targets, default by
    ``arch``; ``max_spill``: spill bytes a capped kernel may have, default ``regpressure.MAX_SPILL``); the
    manifest's ``register_pass`` reports registers, occupancy and waves before and after. ``unpadded`` as for
    :func:`~cuvil.targets.ptx.codegen.gpu_schedule`, ``fused_splitk`` and ``tuning`` as for
    :func:`~cuvil.targets.ptx.codegen.build_ptx`; ``allow_tf32`` (off: strict float32): float32 matrix
    products and convolutions run on TF32 tensor cores (:mod:`cuvil.targets.ptx.conv_mma`); products and
    convolutions whose node has ``precision`` fp16/bf16 run on tensor cores in that format
    (:mod:`cuvil.targets.ptx.matmul_mma`, :mod:`cuvil.targets.ptx.conv_mma`), the manifest's ``precision``
    entry made true of what ran (:func:`~cuvil.precision.policy.reconcile`). Each stage, the LLVM IR kernel by
    kernel, is reported through :mod:`cuvil.progress`."""
    t0 = time.perf_counter()
    tuning = tuning.resolved(enable_fp16)
    # (many query rows fused only for float16 on tensor cores: the flash kernel of ptx/attention_mma.py)
    wide = enable_fp16 and tuning.attention_mma and arch_number(arch) >= FLASH_MIN_SM
    g0 = g
    for many_rows in ((True, False) if wide else (False,)):
        g, applied = g0, {}
        if tuning.fused_attention:   # before float16: the rules match the float32 graph (its FusedAttention stays float32)
            with stage("fused attention") as s:
                g, report = fuse_attention(g, also=flash_shapes if many_rows else None)
                applied = applied_rules(report)
                s.detail(f"{sum(v['applied'] for v in applied.values())} rewrites")
        half_names: list = []
        if enable_fp16:
            with stage("float16") as s:
                g, half_names = to_half(g)
                if tuning.fused_attention:
                    attention_in_half(g)
                s.detail(f"{len(half_names)} tensors lowered to half")
        # a many-row FusedAttention whose Q, K or V the float16 pass kept float32 (a prefill over a float32 KV
        # cache) would take the row kernel, slower than the unfused products: then only few rows are fused
        if not many_rows or flash_operands_half(g):
            break
    if applied:
        manifest_extra = dict(manifest_extra or {})
        manifest_extra["rules_applied"] = {**manifest_extra.get("rules_applied", {}), **applied}
    with stage("schedule", detail=f"{len(g.nodes)} nodes") as s:
        sched = gpu_schedule(g, unpadded=unpadded, tuning=tuning)
        s.detail(f"{len(sched.stages)} kernels, arena {sched.arena_bytes} B, weights {sched.weights_bytes} B")
    if any(s.buf.base == WEIGHTS for s in sched.stages):
        raise CuvilError("a stage writes into the weights buffer; the GPU bundle keeps weights read-only")
    res = build_ptx(sched, arch, opt_level, fma=fma, kernel_rules=kernel_rules, prefix=prefix,
                    narrow_index=narrow_index, fused_splitk=fused_splitk, tuning=tuning, allow_tf32=allow_tf32,
                    precisions={**stage_precisions(g, sched), **conv_stage_precisions(g, sched)},
                    precision_scales=stage_scales(g, sched))
    ptx, descs = res.ptx, res.kernels
    if manifest_extra and "precision" in manifest_extra:   # what the policy narrowed and the kernels did not
        # first the nodes the attention rules fused away (their products run in the FusedAttention kernel,
        # which computes in float32), then those whose kernel is not a tensor-core one
        entry = reconcile(manifest_extra["precision"], g, "fused into the GPU's FusedAttention kernel "
                          "(rules/attention.rule), which computes in float32")
        manifest_extra = {**manifest_extra, "precision": entry}
        slow = set(narrowed_nodes_run(g, sched, descs)) | set(narrowed_convs_run(g, sched, descs))
        if slow:
            g2 = g.clone()
            for nd in g2.nodes:
                if nd.name in slow:
                    nd.precision = ""
            manifest_extra = {**manifest_extra, "precision": reconcile(
                manifest_extra["precision"], g2, "the GPU computes this product with its float32 kernels (a "
                "product of fewer than 16 rows or 8 columns, or operands the tensor-core kernel could not map; a "
                "grouped, dilated, not 2-D or too small convolution)")}
    # the scratch area after the arena: counters first, then partial sums (never zeroed past the allocation)
    extra = max(res.scratch_bytes, res.counter_bytes)
    arena_bytes = res.scratch_offset + extra if extra else sched.arena_bytes
    zero = [[res.scratch_offset, res.counter_bytes]] if res.counter_bytes else []
    t_codegen = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "kernels.ptx"), "w") as f:
        f.write(ptx)
    blob = sched.weights_blob()
    with open(os.path.join(out_dir, "weights.bin"), "wb") as f:
        f.write(blob)

    ptxas_info = None
    rp_report = None
    exe = find_ptxas()
    if exe is not None:
        try:
            with stage("ptxas", detail=f"{exe} -arch={arch}, {len(descs)} kernels"):
                cubin, info = assemble(ptx, arch, exe, jobs=0)
            if register_pass and narrow_index is not True:
                with stage("register pass") as s:
                    ptx2, cubin2, info2, rp_report = relieve(ptx, descs, info, arch,
                                                             lambda text: assemble(text, arch, exe, jobs=0), sms=sms,
                                                             max_spill=max_spill)
                    s.detail(f"{rp_report['capped']} of {len(rp_report['kernels'])} register-limited multi-wave "
                             f"kernels capped")
                if cubin2 is not None:
                    ptx, cubin, info = ptx2, cubin2, info2
                    with open(os.path.join(out_dir, "kernels.ptx"), "w") as f:
                        f.write(ptx)
        except PtxasError as e:
            raise CuvilError(f"the generated PTX does not assemble for {arch}: {e}") from None
        cubin_name = f"kernels.{arch}.cubin"
        with open(os.path.join(out_dir, cubin_name), "wb") as f:
            f.write(cubin)
        ptxas_info = {
            "ptxas": _ptxas_version(exe), "cubin": cubin_name,
            "kernels": {d.name: {"registers": info[d.name].registers, "stack_frame": info[d.name].stack_frame,
                                 "spill_stores": info[d.name].spill_stores, "spill_loads": info[d.name].spill_loads,
                                 "shared": info[d.name].shared}
                        for d in descs if d.name in info},
        }

    # the earlier kernels each must wait for (ptx/launch_deps.py): the runtime's captured graph runs the others at
    # once (Q, K and V products of a layer; an Inception block's branches)
    after = kernel_dependencies(res.kernel_stages, [d.kind for d in descs],
                                read_only=[WEIGHTS] + [b.base for b in sched.inputs])
    plan = {
        "format": PLAN_FORMAT,
        "arch": arch,
        "arena_bytes": arena_bytes,
        "weights_bytes": sched.weights_bytes,
        "zero": zero,
        "buffers": {"arena": ARENA, "weights": WEIGHTS, "first_input": 2, "first_output": 2 + len(sched.inputs),
                    "count": 2 + len(sched.inputs) + len(sched.outputs)},
        "kernels": [{"name": d.name, "stage": d.stage, "n": d.n_elements, "grid": [d.grid, 1, 1],
                     "block": [d.block, 1, 1], "args": ["bufs", "n"], "lanes": d.lanes, "kind": d.kind,
                     **({"after": after[j]} if after is not None else {})} for j, d in enumerate(descs)],
        "inputs": _io(sched.inputs),
        "outputs": _io(sched.outputs),
    }
    with open(os.path.join(out_dir, "plan.json"), "w") as f:
        json.dump(plan, f, indent=1)
        f.write("\n")
    manifest = {
        "cuvil_version": __version__,
        "model": g.name,
        "prefix": prefix,
        "target": {"triple": TRIPLE, "arch": arch},
        "opt_level": opt_level,
        "fma": fma,
        "kernel_rules": {name: {"applied": res.kernel_rule_counts.get(name, 0), "obligation": ob, "verdict": "proved"}
                         for name, ob in res.kernel_rules.items()},
        "enable_fp16": enable_fp16,
        "allow_tf32": allow_tf32,
        # the blocks the kernels' grids aim for (PtxTuning; PtxOptions.concurrency divides them)
        "grid_targets": {"concurrency": tuning.concurrency, "target_blocks": tuning.target_blocks,
                         "gemv_min_blocks": tuning.gemv_min_blocks, "split_target_threads": tuning.split_target_threads,
                         "product_sms": product_sms(sms_for(arch), tuning)},
        "tensor_core_kernels": {k: sum(1 for d in descs if d.kind == k) for k in sorted({d.kind for d in descs})
                                if "mma" in k or k.startswith("matmul_")},
        "narrow_index": narrow_index,
        "register_pass": rp_report if rp_report is not None else
        {"skipped": "off" if not register_pass else "ptxas not found" if exe is None else "narrow_index=True"},
        "float16_reductions_widened": res.widened_reductions,
        "kernels": len(descs),
        "arena_bytes": arena_bytes,
        "splitk_scratch_bytes": res.scratch_bytes,
        "weights_bytes": sched.weights_bytes,
        "weights_sha256": hashlib.sha256(blob).hexdigest(),
        "float16_tensors": half_names if enable_fp16 else
        [b.name for b in list(sched.inputs) + list(sched.outputs) + [s.buf for s in sched.stages] if b.dtype == DType.FLOAT16],
        "memory_safety": res.memory_safety.to_json(),
        "launch_graph": launch_summary(after, len(descs)),
        "fused_ops": sched.fused,
        "ptxas": ptxas_info,
        **(manifest_extra or {}),
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    # Times stay out of the bundle (reproducible builds); Pipeline.compile puts them on Bundle.timings.
    return {**manifest, "timings": {"compile_seconds": round(time.perf_counter() - t0, 3),
                                    "codegen_seconds": round(t_codegen - t0, 3),
                                    "proof_seconds": round(res.memory_safety.seconds, 3)}}


def bundle_name(path: str, name) -> str:
    """``name`` (a file the plan or manifest names) as a name inside the bundle: a relative POSIX path
    without ``..`` components; CuvilError for anything that would reach outside ``path`` (an edited manifest
    naming ``../../elsewhere.cubin`` or an absolute path)."""
    parts = name.split("/") if isinstance(name, str) else None
    if not parts or name.startswith("/") or "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise CuvilError(f"{path}: names the file {name!r}, which is not a file inside the bundle",
                         hint=BUNDLE_HINT)
    return name


def bundle_has(path: str, name: str, files: Optional[Mapping[str, bytes]] = None) -> bool:
    """Whether the bundle has the file ``name`` (checked by :func:`bundle_name`)."""
    name = bundle_name(path, name)
    return name in files if files is not None else os.path.isfile(os.path.join(path, name))


def bundle_file(path: str, name: str, files: Optional[Mapping[str, bytes]] = None) -> bytes:
    """The bytes of the bundle's file ``name``: from ``files`` when given (a verified load), else read."""
    name = bundle_name(path, name)
    if files is not None:
        return files[name]
    with open(os.path.join(path, name), "rb") as f:
        return f.read()


def is_bundle(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "plan.json"))


#: Where a bundle comes from (a half-copied or unrelated directory is the usual cause of a bad one).
BUNDLE_HINT = (f"write the bundle again: cuvil compile MODEL.onnx --target nvptx64-nvidia-cuda --arch sm_90 -o "
               f"build/NAME{BUNDLE_SUFFIX} (an x86 library is a libNAME.so file instead)")


def read_bundle(path: str, files: Optional[Mapping[str, bytes]] = None):
    """(plan, manifest) of a bundle directory; a clear error for anything else. ``files``: the bundle's
    files already read (``{name: bytes}``, a verified load's), used instead of the directory's."""
    path = os.fspath(path)
    if files is None and not os.path.isdir(path):
        raise CuvilError(f"{path}: not a GPU bundle directory (NAME{BUNDLE_SUFFIX}/)", hint=BUNDLE_HINT)
    missing = [f for f in FILES if (f not in files if files is not None else not os.path.isfile(os.path.join(path, f)))]
    plan = manifest = None
    try:
        if "plan.json" not in missing and "manifest.json" not in missing:
            plan = json.loads(bundle_file(path, "plan.json", files))
            manifest = json.loads(bundle_file(path, "manifest.json", files))
    except (OSError, ValueError) as e:
        raise CuvilError(f"{path}: unreadable bundle: {e}") from None
    if isinstance(plan, dict) and plan.get("buckets"):   # a profile bundle: the kernels are per bucket
        missing = [f for f in missing if f != "kernels.ptx"] + [
            f"{e.get('dir')}/kernels.ptx" for e in plan["buckets"]
            if not isinstance(e, dict) or not bundle_has(path, f"{e.get('dir')}/kernels.ptx", files)]
    if missing:
        raise CuvilError(f"{path}: not a complete GPU bundle, missing {', '.join(missing)}", hint=BUNDLE_HINT)
    if plan.get("format") != PLAN_FORMAT:
        raise CuvilError(f"{path}: plan format {plan.get('format')!r}, this Cuvil reads {PLAN_FORMAT!r}")
    return plan, manifest
