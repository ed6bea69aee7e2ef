"""``cuvil lora check``: what an adapter does to a model, and whether its merge keeps the unmerged outputs."""
from __future__ import annotations

import sys

import numpy as np

from ..errors import CuvilError
from ..pipeline import Pipeline
from .flags import add_actions, add_quiet_flag, add_shape_flags
from .shape_flags import shape_flags

#: The gate on the largest relative difference between merged and unmerged outputs, by weight type (PEFT's
#: own merge tests use 1e-4 in float32).
GATES = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 1e-2}
#: The value of every symbolic dim the sample inputs do not fix by --fix.
SAMPLE_DIM = 4


def register(sub) -> None:
    _, lsub = add_actions(sub, "lora", help="LoRA adapters: check an adapter against a model",
                          description="LoRA adapters (docs/lora.md). `cuvil lora check MODEL ADAPTER` maps the "
                                      "adapter to the model's weights and compares the merged model with the "
                                      "unmerged one.")
    ck = lsub.add_parser("check", help="per adapted weight: shapes, rank, scale, update norm, finiteness; "
                                       "merged vs unmerged outputs on sample inputs",
                         description="Map ADAPTER (a PEFT directory or .onnx_adapter file) to MODEL's weights and "
                                     "print, per target: module, initializer, shapes, rank, scale, "
                                     "|s*B*A|_F / |W|_F, finiteness of the merged weight and the largest relative "
                                     "difference of that layer merged vs unmerged on a sample input; then the "
                                     "whole model merged (compiled by Cuvil) against unmerged (Cuvil's reference "
                                     "interpreter) on sample inputs. Gate: rtol 1e-4 for float32 weights, 1e-3 "
                                     "for float16; exit 1 when a gate fails or on an error. Example: cuvil lora "
                                     "check model.onnx adapter/")
    ck.add_argument("model", metavar="MODEL", help="the base model (.onnx)")
    ck.add_argument("adapter", metavar="ADAPTER", help="PEFT adapter directory or .onnx_adapter file")
    ck.add_argument("--lora-weight", type=float, default=1.0, metavar="W", help="the adapter's weight (default 1.0)")
    ck.add_argument("--lora-map", metavar="FILE",
                    help="JSON/YAML module -> initializer (or node) name, for graphs whose names were lost")
    add_shape_flags(ck, f"the sample inputs' shape, by input (x=1x3x224x224; default: every symbolic dim "
                        f"{SAMPLE_DIM}, or its profile's opt) (repeatable)")
    ck.add_argument("--seed", type=int, default=0, help="seed of the sample inputs (default 0)")
    add_quiet_flag(ck)
    ck.set_defaults(fn=cmd_lora_check)


def cmd_lora_check(args) -> int:
    try:
        return _check(args)
    except CuvilError as e:
        print(f"cuvil: error: {e}", file=sys.stderr)
        return 1


def _rel(got, want) -> float:
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(float(np.abs(want).max()), 1e-30))


def _check(args) -> int:
    from ..frontend import load_model
    from ..lora import load_lora_map, map_adapter, read_adapter
    from ..lora.apply import unmerged_graph
    from onnx import numpy_helper

    model = load_model(args.model)
    adapter = read_adapter(args.adapter)
    lmap = load_lora_map(args.lora_map) if args.lora_map else None
    targets = map_adapter(model, adapter, lmap)
    inits = {t.name: t for t in model.graph.initializer}
    base = Pipeline.from_onnx(model)
    merged = base.with_lora(adapter, args.lora_weight, lora_map=lmap)
    rng = np.random.default_rng(args.seed)
    ok = True
    print(f"adapter {adapter.name}: {len(adapter.modules)} modules, r={adapter.config.get('r', '?')}, "
          f"lora_alpha={adapter.config.get('lora_alpha', '?')}"
          + (", use_rslora" if adapter.config.get("use_rslora") else "") + f", weight {args.lora_weight:g}")
    mw = max([len(t.module) for t in targets] + [6])
    iw = max([len(t.initializer) for t in targets] + [11])
    print(f"{'module':{mw}} {'initializer':{iw}} {'W':>10} {'A':>9} {'B':>9} {'rank':>4} {'scale':>8} "
          f"{'|sBA|/|W|':>9} {'finite':>6} {'layer rel diff':>14}")
    dtypes = set()
    for t in targets:
        lm = adapter.modules[t.module]
        w = numpy_helper.to_array(inits[t.initializer])
        dtypes.add(str(w.dtype))
        s = args.lora_weight * lm.scale
        delta = s * (lm.B.astype(np.float64) @ lm.A.astype(np.float64))       # [out, in]
        w_oi = w.astype(np.float64) if t.layout == "out_in" else w.astype(np.float64).T
        ratio = np.linalg.norm(delta) / max(np.linalg.norm(w_oi), 1e-30)
        node, = [n for n in merged.graph.nodes if n.name == t.node]
        v = node.inputs[1]
        while not v.is_const:
            v = v.producer.inputs[0]
        wm = v.const
        finite = bool(np.isfinite(wm).all())
        # the layer alone, in the weight's type: x·W' against x·W + s·(x·Aᵀ)·Bᵀ
        x = rng.standard_normal((8, lm.in_features)).astype(w.dtype)
        wm_io = wm if t.layout == "in_out" else wm.T
        w_io = w if t.layout == "in_out" else w.T
        got = x @ wm_io
        A, B, st = lm.A.astype(w.dtype), lm.B.astype(w.dtype), np.asarray(s, w.dtype)
        want = x @ w_io + ((x @ A.T) * st) @ B.T
        diff = _rel(got, want)
        gate = GATES.get(str(w.dtype), 1e-4)
        ok &= finite and diff <= gate
        print(f"{t.module:{mw}} {t.initializer:{iw}} {'x'.join(map(str, w.shape)):>10} {'x'.join(map(str, lm.A.shape)):>9} "
              f"{'x'.join(map(str, lm.B.shape)):>9} {lm.rank:>4} {s:>8.4g} {ratio:>9.2e} "
              f"{'yes' if finite else 'NO':>6} {diff:>14.2e}" + ("" if diff <= gate else f"  > {gate:g}"))
    # the whole model: merged (compiled) against unmerged (reference interpreter)
    given, profiles = shape_flags(base, args)
    fixed = {name: SAMPLE_DIM for name in base.graph.symbols}
    fixed.update({name: prof[1] if len(prof) > 1 else prof[0] for name, prof in profiles.items()})
    fixed.update(given)
    feeds = {}
    for v in base.graph.inputs:
        shape = [fixed.get(str(d), SAMPLE_DIM) if not isinstance(d, int) else d for d in v.shape]
        dt = v.dtype.numpy
        if np.issubdtype(dt, np.floating):
            feeds[v.name] = rng.standard_normal(shape).astype(dt)
        elif "mask" in v.name:
            feeds[v.name] = np.ones(shape, dt)
        else:
            feeds[v.name] = rng.integers(0, 2, shape).astype(dt)
    ug, _, _ = unmerged_graph(base.graph, model, [(adapter, args.lora_weight, lmap)])
    want = Pipeline(ug).specialize(fixed).run_reference(feeds)
    art = merged.optimize().compile(fixed=fixed)
    got = art.run(feeds)
    gate = max(GATES.get(d, 1e-4) for d in dtypes) if dtypes else 1e-4
    for name, w in want.items():
        if not np.issubdtype(np.asarray(w).dtype, np.floating):
            continue
        diff = _rel(got[name], w)
        ok &= diff <= gate
        print(f"output {name}: merged (Cuvil library) vs unmerged (reference) max rel diff {diff:.2e} "
              f"(gate {gate:g}) {'ok' if diff <= gate else 'FAILED'}")
    print(f"lora check: {'ok' if ok else 'FAILED'} ({len(targets)} targets, sample dims "
          f"{', '.join(f'{k}={v}' for k, v in fixed.items()) or 'static'})")
    return 0 if ok else 1
