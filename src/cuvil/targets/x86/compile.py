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
from typing import Optional, Tuple

import attrs
import numpy as np

from ...errors import CuvilError, UnsupportedTypeError
from ...ir.dim import SymExpr
from ...ir.dtype import DType
from ...ir.graph import Graph
from ...kernels.batch_rows import batch_row_symbol
from ...kernels.bounds import BoundsProver, Certificate, prove_schedule
from ...kernels.schedule import Schedule, schedule
from ...progress import stage
from ...version import __version__
from .codegen import generate_object
from .cpu import C_CHECKED_FEATURES, cpu_label, describe_cpu
from .gemm import matmul_tile, tile_cols, tile_shapes
from .amx import AMX_BF16, amx_formats, amx_isa_checks
from .gemm_bf16 import bf16_isa_checks, narrow_formats
from .gemm_fp16 import F16C_PATH, fp16_formats, fp16_isa_checks
from ...kernels.contraction import AMX_TILES
from ...kernels.contraction_int8 import AMX_INT8_TILES
from ...kernels.contraction_nhwc import BF16_CHANNELS_LAST
from ...kernels.contraction_planes import BF16_PLANES
from .gemm_int8 import has_amx_int8, int8_isa_checks
from .header import generate_header
from .link import check_dependencies, link_shared, unexpected_dependencies
from .model_c import generate_model_c
from .model_info import ABI_DTYPES, IODesc, ModelInfo, StepDesc, SymbolDesc
from .tuning import DEFAULT_TUNING, X86Tuning
from .weights_file import pad64, weights_path, write_weights


def _weights_asm(sym: str, path: str, nbytes: int) -> str:
    return (f'\t.section .rodata.{sym},"a",@progbits\n\t.balign 64\n\t.globl {sym}\n'
            f'\t.hidden {sym}\n\t.type {sym}, @object\n{sym}:\n'
            f'\t.incbin "{path}"\n\t.size {sym}, {nbytes}\n')


#: Largest arena (bytes, at the profile's maxima) a library may reserve per session unless the caller raises
#: it (``max_arena_bytes``, or the CUVIL_MAX_ARENA_BYTES environment variable). A model with symbolic dims
#: and no shape profile ranges each symbol over [1, 4096]: a transformer block's attention scores at
#: batch = sequence = 4096 need terabytes, which no session can reserve.
MAX_ARENA_BYTES = 16 << 30


def arena_limit(given: Optional[int]) -> int:
    """The arena limit a build enforces: ``given``, else CUVIL_MAX_ARENA_BYTES, else :data:`MAX_ARENA_BYTES`."""
    if given is not None:
        return int(given)
    env = os.environ.get("CUVIL_MAX_ARENA_BYTES")
    if env is None:
        return MAX_ARENA_BYTES
    try:
        return int(env)
    except ValueError:
        raise CuvilError(f"CUVIL_MAX_ARENA_BYTES={env!r} is not a number of bytes",
                         hint=f"set it to an integer (CUVIL_MAX_ARENA_BYTES={MAX_ARENA_BYTES}), or unset it") from None


def _check_arena(sched: Schedule, limit: int):
    """The arena is sized at the profile's maxima; refuse one no session could reserve, naming the symbols
    whose maxima make it that large."""
    if sched.arena_bytes <= limit:
        return
    at_max = ", ".join(f"{s.name} <= {s.max}" for s in sched.symbols)
    raise CuvilError(f"the arena at the shape profile's maxima ({at_max or 'fixed shapes'}) is "
                     f"{_bytes(sched.arena_bytes)}, above the {_bytes(limit)} limit",
                     hint=f"give a shape profile with the maxima you need (--shape-profile NAME=MIN:OPT:MAX or "
                          f"--input-shape INPUT=MIN:OPT:MAX; shape_profiles= / input_shapes=), or, where a session "
                          f"can reserve {_bytes(sched.arena_bytes)}, raise the limit: CUVIL_MAX_ARENA_BYTES="
                          f"{sched.arena_bytes}")


def _check_abi_types(g: Graph):
    """Every input and output must have an element type the C ABI passes (not a string): refused by name, before
    any kernel is built."""
    for kind, values, names in (("input", g.inputs, [v.name for v in g.inputs]), ("output", g.outputs, g.output_names)):
        for v, name in zip(values, names):
            if int(v.dtype) not in ABI_DTYPES:
                raise UnsupportedTypeError(
                    f"{kind} {name!r} is {v.type}: the x86 library's C ABI has no {v.dtype.name.lower()} tensors",
                    hint=f"export the model without the {v.dtype.name.lower()} {kind} (keep that processing outside "
                         f"the model), or compile the graph that ends before it")


def _refuse_unproved(cert: Certificate):
    """A kernel whose accesses are not proved even with its run-time guards (clamps cannot help where a
    buffer may be empty, nor where a view or buffer may not fit its storage) would run unchecked: no library
    is built."""
    for k in cert.kernels:
        if k.status == "unproved":
            raise CuvilError(f"kernel {k.stage} ({k.variant}) is not proved memory-safe even with run-time "
                             f"guards", details=[str(k.failures[0])],
                             hint="if a dim can be 0 at some point of the shape profile, raise the symbols' minimum "
                                  "(--shape-profile NAME=MIN:OPT:MAX), else report it with `cuvil inspect MODEL "
                                  "--shapes` output")


def _bytes(n: int) -> str:
    for unit, size in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _holds_float16(g) -> bool:
    """Whether graph ``g`` has a float16 value (its conversions may use F16C / AVX512-FP16 instructions)."""
    return any(v is not None and v.dtype == DType.FLOAT16 for n in g.nodes for v in list(n.inputs) + list(n.outputs))


def _path_precision(path: str) -> str:
    """The format a kernel on narrow ``path`` computes in (the manifest step's ``precision``)."""
    if "int8" in path or "vnni" in path:
        return "int8"
    return "fp16" if path == F16C_PATH else "bf16"


def _step_descs(sched, steps, step_stages) -> list:
    """The steps with their guards: a step is guarded when all its stages share one guard (a branch of a
    run-time If; the runtime then skips it when the condition says the branch is not taken)."""
    out = []
    for (sym, extent, grain, split), members in zip(steps, step_stages):
        guards = {None if sched.stages[i].guard is None else (id(sched.stages[i].guard[0]), sched.stages[i].guard[1])
                  for i in members}
        guard = None
        if len(guards) == 1 and None not in guards:
            b, polarity = sched.stages[members[0]].guard
            guard = (b.base, b.offset, polarity)
        out.append(StepDesc(sym, extent, grain, split, guard))
    return _loop_jumps(sched, step_stages, out)


def _loop_jumps(sched, step_stages, descs) -> list:
    """Each run-time loop's two jumps: after its head step, to the step past its back edge when ``go`` is
    false; after its back-edge step, to its head step."""
    step_of = {i: k for k, members in enumerate(step_stages) for i in members}
    index = {id(st): i for i, st in enumerate(sched.stages)}
    for lp in sched.loops:
        h, b = step_of[index[id(lp.head)]], step_of[index[id(lp.back)]]
        descs[h] = attrs.evolve(descs[h], jump=(b + 1, (lp.go.base, lp.go.offset, False)))
        descs[b] = attrs.evolve(descs[b], jump=(h, None))
    return descs


def compile_x86(g: Graph, out_so: str, *, opt_level: int = 3, cpu: Optional[str] = None, prefix: str = "cuvil",
                manifest_extra: Optional[dict] = None,
                opt_graph: Optional[Graph] = None, max_arena_bytes: Optional[int] = None,
                tuning: X86Tuning = DEFAULT_TUNING, math: str = "vector", external_weights: bool = False,
                weights_key: Optional[bytes] = None, lora_slots=(), batch_slices: bool = True) -> dict:
    """Compile ``g`` into ``out_so``; writes the header and manifest beside it and returns the manifest, with
    ``timings`` added (seconds: ``compile_seconds``, ``codegen_seconds``, ``proof_seconds``; not written).
    Symbols left in ``g`` stay symbolic: the library binds them from the input shapes at every run and
    accepts every value in their ranges (``g.symbols``). ``opt_graph``: ``g`` specialised to the symbols'
    opt values; its kernels are linked in beside the generic ones and run when a call's shapes are exactly
    the opt point. Every kernel's memory accesses are proved in bounds (:mod:`cuvil.kernels.bounds`) before
    code is generated; a kernel that cannot be proved runs guarded; the certificate is the manifest's
    ``memory_safety``. ``max_arena_bytes`` (default :data:`MAX_ARENA_BYTES`): a larger arena is refused.
    ``tuning``: the register tiles offered and the tile choice's weights (:class:`X86Tuning`). ``math``: float32
    exp, erf, tanh and log as inline vector polynomials ("vector") or libm calls ("libm"). Each stage, the LLVM
    IR kernel by kernel, is reported through :mod:`cuvil.progress`. ``external_weights``: the weights go to
    ``libNAME.weights`` beside the library (:mod:`cuvil.targets.x86.weights_file`), which binds them at run
    time, instead of into it; ``weights_key`` (32 bytes): that file is encrypted with it (AES-256-GCM).
    ``lora_slots``: the :class:`cuvil.lora.slots.LoraSlot` of ``g`` (:func:`cuvil.lora.slots.add_lora_slots`),
    whose three inputs each, the last of ``g``, the runtime supplies from the active adapter. ``batch_slices``:
    where every row along a symbol is computed on its own (:mod:`cuvil.kernels.batch_rows`), a run at a multiple
    of its opt value runs the opt-point kernels once per slice (the activations of one slice stay in cache)
    instead of the generic kernels over the whole batch."""
    t0 = time.perf_counter()
    out_so = os.path.abspath(out_so)
    base = os.path.splitext(out_so)[0]
    _check_abi_types(g)
    target_cpu = describe_cpu(cpu)
    bits = target_cpu.vector_bits
    narrow = narrow_formats(target_cpu)
    if narrow and tuning.amx:        # bf16 contractions on AMX tiles where the CPU has them (amx.py)
        narrow += amx_formats(target_cpu)
    # bf16 convolutions read pair planes (gemm_planes.py): on AMX tiles by default, with vdpbf16ps when asked
    if narrow and (tuning.bf16_planes or (tuning.bf16_planes is None and AMX_TILES in narrow)):
        narrow += (BF16_PLANES,)
    if narrow and tuning.channels_last and AMX_TILES in narrow:    # channels-last AMX convolutions (gemm_nhwc.py)
        narrow += (BF16_CHANNELS_LAST,)
    narrow += fp16_formats(target_cpu)   # float16 weight panels (gemm_fp16.py)
    if tuning.amx and has_amx_int8(target_cpu.features):   # int8 convolutions on AMX tiles (gemm_int8.py)
        narrow += (AMX_INT8_TILES,)
    with stage("schedule", detail=f"{len(g.nodes)} nodes") as s:
        sched = schedule(g, gemm_cols=tile_cols(bits), split_concat=True, gemm_tiles=tile_shapes(bits, tuning),
                         row_kernels=True, channel_tile_cost=tuning.channel_tile_cost, run_time_sizes=True,
                         hidden_inputs=3 * len(lora_slots), narrow_formats=narrow,
                         matmul_tile=matmul_tile(target_cpu, tuning), bf16_storage=tuning.bf16_storage_mode, tile_choices=tuning.tile_choices,
                         pad_in_place=tuning.pad_in_place, concat_in_place=tuning.concat_in_place,
                         rows_in_place=tuning.rows_in_place)
        s.detail(f"{len(sched.stages)} kernels, arena {_bytes(sched.arena_bytes)}, "
                 f"weights {_bytes(sched.weights_bytes)}")
    _check_arena(sched, arena_limit(max_arena_bytes))
    prover = BoundsProver(limits=sched.size_limits)
    with stage("memory safety", detail=f"{len(sched.stages)} kernels") as s:
        cert = prove_schedule(sched, "generic", prover)
        s.detail(cert.summary())
    _refuse_unproved(cert)
    obj, steps, target = generate_object(sched, prefix, cpu, opt_level, math=math,
                                         next_panel_prefetch=tuning.next_panel_prefetch,
                                         channel_sweep=tuning.channel_sweep)
    blob = sched.weights_blob()
    osched = osteps = otarget = oobj = oblob = None
    # sizes written at run time (NonZero's count) have no opt point to specialise for: generic kernels only
    if opt_graph is not None and sched.symbols and not sched.num_run_time_symbols:
        point = ", ".join(f"{k}={v}" for k, v in sched.opt_point.items())
        with stage("schedule (opt point)", detail=point) as s:
            osched = schedule(opt_graph, gemm_cols=tile_cols(bits), split_concat=True,
                              gemm_tiles=tile_shapes(bits, tuning), row_kernels=True,
                              channel_tile_cost=tuning.channel_tile_cost, hidden_inputs=3 * len(lora_slots),
                              narrow_formats=narrow, matmul_tile=matmul_tile(target_cpu, tuning),
                              bf16_storage=tuning.bf16_storage_mode, tile_choices=tuning.tile_choices,
                         pad_in_place=tuning.pad_in_place, concat_in_place=tuning.concat_in_place,
                         rows_in_place=tuning.rows_in_place)
            s.detail(f"{point}: {len(osched.stages)} kernels")
        with stage("memory safety (opt point)", detail=f"{len(osched.stages)} kernels") as s:
            opt_cert = prove_schedule(osched, "opt", prover)
            s.detail(opt_cert.summary())
        cert.extend(opt_cert)
        _refuse_unproved(cert)
        oobj, osteps, otarget = generate_object(osched, f"{prefix}_opt", cpu, opt_level, variant="opt point",
                                                math=math, next_panel_prefetch=tuning.next_panel_prefetch,
                                                channel_sweep=tuning.channel_sweep)
        oblob = osched.weights_blob()
    t_codegen = time.perf_counter()
    weights_sym = f"{prefix}_weights" if sched.weights_bytes else None
    opt_weights_sym = None
    if osched is not None and osched.weights_bytes:
        opt_weights_sym = weights_sym if oblob == blob else f"{prefix}_opt_weights"
    opt_weights = ("none" if osched is None else "shared" if opt_weights_sym == weights_sym
                   else f"{osched.weights_bytes} B of their own")
    external = _external_weights(blob, oblob, weights_sym, opt_weights_sym) if external_weights else None
    weights_file = None
    if external is not None:
        plain, opt_offset = external
        with stage("weights file", detail=f"{_bytes(len(plain))}" + (", encrypted" if weights_key else "")):
            header = write_weights(weights_path(out_so), plain, weights_key)
        weights_file = {"file": os.path.basename(weights_path(out_so)), "format": header.version,
                        "bytes": header.plain_bytes, "sha256": header.sha256.hex(), "encrypted": header.encrypted,
                        "opt_offset": opt_offset}
        weights_sym = opt_weights_sym = None
        blob = oblob = None
    elif os.path.exists(weights_path(out_so)):
        os.unlink(weights_path(out_so))           # a stale one of an earlier build: the library embeds its own
    opt = sched.opt_point
    batch_symbol, slice_bytes = _batch_slices(g, sched, osched) if batch_slices else (-1, ())
    info = ModelInfo(
        inputs=[IODesc.of(b.name, int(b.dtype), b.shape) for b in sched.inputs],
        outputs=[IODesc.of(b.name, int(b.dtype), b.shape) for b in sched.outputs],
        arena_bytes=max(sched.arena_bytes, osched.arena_bytes if osched else 0),
        steps=_step_descs(sched, steps, target["step_stages"]),
        weights_symbol=weights_sym, prefix=prefix,
        scratch_bytes=max(target["scratch_bytes"], otarget["scratch_bytes"] if otarget else 0),
        symbols=[SymbolDesc(s.name, s.min, opt[s.name], s.max, s.multiple) for s in sched.symbols],
        opt_steps=_step_descs(osched, osteps, otarget["step_stages"]) if osteps else [],
        opt_weights_symbol=opt_weights_sym, num_run_time_symbols=sched.num_run_time_symbols,
        # a library with bf16 kernels also checks AVX512_BF16 (GCC 10+ and Clang 12+ know the name)
        isa_checks=list(dict.fromkeys([f for f in C_CHECKED_FEATURES if f in target_cpu.features]
                                      + bf16_isa_checks(target, otarget) + fp16_isa_checks(target_cpu, target, otarget, half_values=_holds_float16(g))
                                      + amx_isa_checks(AMX_BF16, target, otarget)
                                      + int8_isa_checks(target, otarget))),
        **({} if weights_file is None else {"external_weights_bytes": weights_file["bytes"],
                                            "external_weights_sha256": bytes.fromhex(weights_file["sha256"]),
                                            "external_opt_weights_offset": weights_file["opt_offset"]}),
        lora_slots=[(s.module, s.in_features, s.out_features, s.rank) for s in lora_slots],
        batch_symbol=batch_symbol, batch_slice_bytes=slice_bytes,
        weights_bytes=len(blob) if weights_sym else 0,
        opt_weights_bytes=len(oblob) if opt_weights_sym else 0)
    with tempfile.TemporaryDirectory(prefix="cuvil-build-") as tmp:
        objs = []
        for name, parts in (("kernels", obj), ("kernels_opt", oobj or [])):
            for k, data in enumerate(parts):
                objs.append(os.path.join(tmp, f"{name}{k}.o"))
                with open(objs[-1], "wb") as f:
                    f.write(data)
        weights_S = ""
        for sym, data in ((weights_sym, blob), (opt_weights_sym if opt_weights_sym != weights_sym else None, oblob)):
            if sym:
                wbin = os.path.join(tmp, f"{sym}.bin")
                with open(wbin, "wb") as f:
                    f.write(data)
                weights_S += _weights_asm(sym, wbin, len(data))
        weights_S = weights_S + '\t.section .note.GNU-stack,"",@progbits\n' if weights_S else None
        with stage("link", detail=os.path.basename(out_so)):
            link_shared(out_so, objs, generate_model_c(info), weights_S, prefix, isa_checks=info.isa_checks)
    deps = check_dependencies(out_so)
    bad = unexpected_dependencies(deps)
    if bad:
        raise CuvilError(f"{out_so} depends on {bad}; only libc, libm and libpthread are allowed",
                         hint="the system linker added them: check `cc` (CC=) links without extra libraries, "
                              "or report it with `ldd` of the library")
    with open(base + ".h", "w") as f:
        f.write(generate_header(info, prefix))
    in_concat = list(dict.fromkeys(sched.concats_in_place + (osched.concats_in_place if osched else [])))
    manifest = {
        "cuvil_version": __version__,
        "prefix": prefix,
        "target": _target_json(target["triple"], target["cpu"]),
        "opt_level": opt_level,
        "math": math,
        "inputs": [{"name": d.name, "dtype": d.dtype, "shape": _json_dims(d.dims or d.shape)} for d in info.inputs],
        "outputs": [{"name": d.name, "dtype": d.dtype, "shape": _json_dims(d.dims or d.shape)} for d in info.outputs],
        "symbols": {s.name: {"min": s.min, "opt": s.opt, "max": s.max, **({"multiple": s.multiple} if s.multiple > 1
                                                                          else {})} for s in info.symbols},
        # sizes a kernel computes from tensor values during the run (NonZero's count), max = their bound
        "run_time_sizes": [s.name for s in info.symbols[len(info.symbols) - info.num_run_time_symbols:]],
        "arena_bytes": sched.arena_bytes,
        # activations stored as bfloat16 between bf16 convolutions (X86Tuning.bf16_storage): value -> why
        **({"bf16_activations": dict(sched.bf16_stored)} if sched.bf16_stored else {}),
        # activations stored channels-last between channels-last AMX convolutions (X86Tuning.channels_last)
        **({"channels_last_activations": list(sched.channels_last)} if sched.channels_last else {}),
        # a skip Add's output written over its residual's bytes by a channels-last convolution: output -> residual
        **({"outputs_over_residuals": dict(sched.over_residuals)} if sched.over_residuals else {}),
        # values a bf16 convolution stores into its 3x3 reader's padded buffer (X86Tuning.pad_in_place)
        **({"pads_in_place": list(sched.pads_in_place)} if sched.pads_in_place else {}),
        # values whose producer writes its slice of a stored concatenation (X86Tuning.concat_in_place), in the
        # generic kernels or the opt point's (a slice is contiguous only where the dims before the axis are 1)
        **({"concats_in_place": in_concat} if in_concat else {}),
        "scratch_bytes_per_thread": target["scratch_bytes"],
        "weights_bytes": sched.weights_bytes,
        **({"weights_file": weights_file} if weights_file else {}),
        "kernels": len(sched.stages),
        "memory_safety": cert.to_json(),
        "fused_ops": sched.fused,
        "steps": _steps_json(sched, steps, target, "generic" if osched else None, info.steps)
        + (_steps_json(osched, osteps, otarget, "opt", info.opt_steps) if osched else []),
        "opt_weights": opt_weights,
        "batch_slices": (info.symbols[batch_symbol].name if batch_symbol >= 0 else None),
        "dependencies": deps,
        **({"lora_slots": [s.to_json() for s in lora_slots]} if lora_slots else {}),
        **(manifest_extra or {}),
    }
    with open(base + ".manifest.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    # Times are not written into the artifact (builds are reproducible, byte for byte: docs/supply-chain.md);
    # Pipeline.compile moves them to the artifact object (Artifact.timings).
    return {**manifest, "timings": {"compile_seconds": round(time.perf_counter() - t0, 3),
                                    "codegen_seconds": round(t_codegen - t0, 3),
                                    "proof_seconds": round(cert.seconds, 3)}}


def _batch_slices(g: Graph, sched, osched) -> Tuple[int, tuple]:
    """(index of the batch symbol, bytes of one opt-point slice of each input then output: 0 for one without
    the symbol, which every slice reads or writes whole) when the opt kernels can run a batch slice by slice
    (see ``compile_x86``), else (-1, ())."""
    sym = batch_row_symbol(g) if osched is not None and not sched.num_run_time_symbols else None
    names = [s.name for s in sched.symbols]
    if sym is None or sym not in names or sched.opt_point.get(sym, 0) < 1:
        return -1, ()
    bufs = list(osched.inputs) + list(osched.outputs)
    shapes = {v.name: v.shape for v in list(g.inputs) + list(g.outputs)}
    if [b.name for b in bufs] != [b.name for b in list(sched.inputs) + list(sched.outputs)] or \
            not all(b.name in shapes and all(isinstance(d, int) for d in b.shape) for b in bufs):
        return -1, ()
    rows = SymExpr.symbol(sym)
    return names.index(sym), tuple(int(np.prod(b.shape, dtype=np.int64)) * b.dtype.itemsize
                                   if shapes[b.name] and shapes[b.name][0] == rows else 0 for b in bufs)


def _external_weights(blob, oblob, weights_sym, opt_weights_sym):
    """``(plaintext, opt_offset)`` of a weights file: the generic kernels' weights, then, at a 64-byte aligned
    offset, the opt-point kernels' own ones when they differ (``opt_offset``: where the opt kernels' weights
    start, -1 when they read none); None when the model has no weights (no file is written)."""
    if weights_sym is None and opt_weights_sym is None:
        return None
    plain = bytes(blob or b"")
    if opt_weights_sym is None:
        return plain, -1
    if opt_weights_sym == weights_sym:
        return plain, 0
    offset = pad64(len(plain))
    return plain.ljust(offset, b"\0") + bytes(oblob), offset


def _steps_json(sched, steps, target, variant, descs) -> list:
    """The manifest's record of each step (in profile order: the generic steps, then the opt ones); a step
    running several stages (the pieces of a split concatenation) names them all in ``stages``; a guarded
    step names its condition's buffer and the value it runs for (``guard``); a run-time loop's head step
    says where the run goes when its ``go`` is false (``jump``: ``to``, ``unless``), its back-edge step where
    it goes always."""
    out = []
    for (sym, _, _, _), members, desc in zip(steps, target["step_stages"], descs):
        st = sched.stages[members[0]]
        row = target["window_kinds"].get(sym)
        kind = "gemm" if sym in target["gemm_symbols"] else {"conv": "dwconv", "max": "maxpool"}.get(row, row or "loop")
        out.append({"stage": st.name, "op": st.op, "shape": _json_dims(st.buf.shape),
                    "flops": sum(sched.stages[i].flops for i in members), "kernel": kind,
                    **({"stages": [sched.stages[i].name for i in members]} if len(members) > 1 else {}),
                    **({"tile": target["gemm_tiles"][sym]} if sym in target["gemm_tiles"] else {}),
                    **({"stores": "bf16"} if st.buf.dtype == DType.BFLOAT16 else {}),   # its output: bfloat16
                    **({"precision": _path_precision(target["narrow_paths"][sym]), "path": target["narrow_paths"][sym]}
                       if sym in target.get("narrow_paths", {}) else {}),
                    **({"guard": {"cond": st.guard[0].name, "runs_when": bool(st.guard[1])}}
                       if desc.guard is not None else {}),
                    **({"jump": {"to": desc.jump[0], "unless": st.name} if desc.jump[1] is not None
                        else {"to": desc.jump[0]}} if desc.jump is not None else {}),
                    **({"variant": variant} if variant else {})})
    return out


def _target_json(triple: str, cpu) -> dict:
    """The manifest's ``target``: the CPU the library was built for and ``isa_features``, every ISA feature the
    code generator was allowed to use, which the loader requires of the CPU it runs on (a missing one would be
    SIGILL at its first instruction); ``vector_bits``: the kernels' vector width; ``built_on``: the host's CPU
    in one line, for a library built for the host (it is the target then); a library built for a named CPU
    leaves it out, so that it is the same bytes whichever machine builds it (docs/supply-chain.md)."""
    return {"triple": triple, "cpu": cpu.llvm_name, "features": cpu.llvm_features,
            "isa_features": sorted(cpu.features), "vector_bits": cpu.vector_bits, "native": cpu.is_host,
            **({"built_on": cpu_label()} if cpu.is_host else {})}


def _json_dims(dims) -> list:
    """Dims for JSON: ints, symbolic ones as their expression text (``"N"``, ``"N*S"``)."""
    return [d if isinstance(d, int) else str(d) for d in dims]
