"""The C ABI fuzz family: random misuse of a small compiled library's C ABI, as a hostile caller would.

One library is compiled per run (:func:`fixture_model`: ``y = Relu(Conv3x3(x) + z)`` with a symbolic batch
``N`` in [1, 4]). Each case is a JSON description of calls (wrong dtype codes, ranks and dims, NULL data and
shape pointers, misaligned and overlapping buffers, NULL / destroyed / double-destroyed / foreign sessions,
bad thread counts, out-of-range indices, concurrent sessions) that a child process (``python -m
cuvil.fuzz.c_abi --worker LIB``) makes through ctypes, so that a crash of the library is seen as the child's
death (CRASH) and a hang as its silence (HANG). The parent knows which calls are valid: a valid call must
return 0 and, for a run, the reference output (else WRONG); an invalid one must return a documented negative
code and leave the outputs untouched (CLEAN_ERROR; anything else WRONG).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..pipeline import Pipeline
from .report import ACCEPTED, CLEAN_ERROR, CRASH, HANG, WRONG, FamilyReport

FAMILY = "c_abi"
PROFILE = {"N": (1, 2, 4)}
C_IN, C_OUT, H, W = 3, 4, 6, 6
CASE_SECONDS = 20.0                 # a case slower than this is a hang (a run of this model takes microseconds)
DOCUMENTED_CODES = frozenset(range(-22, 0))
FLOAT, INT32, DOUBLE = 1, 6, 11
MAX_BUFFER = 8 << 20                # a claimed size above this is never valid here: the buffer stays small
SENTINEL = 0x7F


def fixture_model() -> onnx.ModelProto:
    """``y[N, 4, 6, 6] = Relu(Conv(x[N, 3, 6, 6], w, b, pads 1) + z[N, 4, 6, 6])``: two inputs, a symbolic
    dim bound by both, weights, several kernels."""
    rng = np.random.default_rng(25)
    w = rng.standard_normal((C_OUT, C_IN, 3, 3)).astype(np.float32)
    b = rng.standard_normal(C_OUT).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C_IN, H, W])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", C_OUT, H, W])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C_OUT, H, W])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Add", ["c", "z"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    g = helper.make_graph(nodes, "c_abi_fixture", [x, z], [y],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def reference(x: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The fixture's output, in float64 numpy."""
    m = fixture_model()
    w = numpy_helper.to_array(m.graph.initializer[0]).astype(np.float64)
    b = numpy_helper.to_array(m.graph.initializer[1]).astype(np.float64)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((x.shape[0], C_OUT, H, W))
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,kc->nkhw", xp[:, :, i:i + H, j:j + W], w[:, :, i, j])
    return np.maximum(out + b[None, :, None, None] + z, 0.0)


def build_fixture(out_dir: str) -> str:
    """Compiles the fixture into ``out_dir/libcabi.so`` (and its header and manifest); returns the path."""
    art = Pipeline.from_onnx(fixture_model()).compile(shape_profiles=PROFILE)
    return art.save(os.path.join(out_dir, "libcabi.so"))


# -- cases (parent) ----------------------------------------------------------------------------------


def _true_shapes(n: int):
    return [n, C_IN, H, W], [n, C_OUT, H, W], [n, C_OUT, H, W]


def _tensor(dtype: int, shape: list, role: str) -> dict:
    return {"dtype": dtype, "ndim": len(shape), "shape": list(shape), "data": "ok", "role": role}


def _mutate(rng, t: dict) -> None:
    """One random misuse of tensor t, in place."""
    kind = rng.choice(["dtype", "ndim", "dim", "data_null", "shape_null", "misaligned", "dim_huge", "dim_neg"])
    if kind == "dtype":
        t["dtype"] = int(rng.choice([0, 2, 6, 7, 10, 11, 16, 17, -1, 255, 2**31 - 1, -2**31]))
    elif kind == "ndim":
        t["ndim"] = int(rng.choice([0, 1, 3, 5, 8, -1, 64, 2**31 - 1, -2**31]))
    elif kind == "dim" and t["shape"]:
        k = int(rng.integers(len(t["shape"])))
        t["shape"][k] = int(rng.choice([0, 1, 2, 3, 4, 5, 7, 8, 16]))
    elif kind == "dim_huge" and t["shape"]:
        t["shape"][int(rng.integers(len(t["shape"])))] = int(rng.choice([2**31, 2**40, 2**62, 2**63 - 1]))
    elif kind == "dim_neg" and t["shape"]:
        t["shape"][int(rng.integers(len(t["shape"])))] = int(rng.choice([-1, -2, -(2**63)]))
    elif kind == "data_null":
        t["data"] = "null"
    elif kind == "shape_null":
        t["shape"] = None
    else:
        t["data"] = "misaligned"


def _valid_tensor(t: dict, want: list) -> bool:
    return (t["dtype"] == FLOAT and t["ndim"] == len(want) and t["shape"] is not None and t["shape"] == want
            and t["data"] == "ok")


def _run_case(rng) -> dict:
    n = int(rng.integers(1, 5))
    sx, sz, sy = _true_shapes(n)
    ins = [_tensor(FLOAT, sx, "x"), _tensor(FLOAT, sz, "z")]
    outs = [_tensor(FLOAT, sy, "y")]
    case = {"op": "run", "threads": int(rng.choice([1, 1, 2, 3])), "session": "live",
            "inputs": ins, "outputs": outs, "repeat": int(rng.integers(1, 3)), "seed": int(rng.integers(2**31))}
    for _ in range(int(rng.choice([0, 0, 1, 1, 2, 3]))):
        what = rng.choice(["input", "input", "output", "session", "arrays", "overlap", "batch"])
        if what == "input":
            _mutate(rng, ins[int(rng.integers(2))])
        elif what == "output":
            _mutate(rng, outs[0])
        elif what == "session":
            case["session"] = str(rng.choice(["null", "destroyed", "double", "foreign", "foreign_heap"]))
        elif what == "arrays":
            case[str(rng.choice(["inputs", "outputs"]))] = None
        elif what == "overlap":
            outs[0]["data"] = str(rng.choice(["alias_x", "alias_z"]))
        else:                                      # a batch changed consistently: valid while inside the profile
            m = int(rng.choice([0, 1, 2, 3, 4, 5, 8]))
            for t in ins + outs:
                if t["shape"]:
                    t["shape"][0] = m
    return case


def _run_valid(case: dict) -> bool:
    ins, outs = case["inputs"], case["outputs"]
    if case["session"] != "live" or ins is None or outs is None:
        return False
    n = ins[0]["shape"][0] if ins[0]["shape"] else -1
    if not PROFILE["N"][0] <= n <= PROFILE["N"][2]:
        return False
    sx, sz, sy = _true_shapes(n)
    return _valid_tensor(ins[0], sx) and _valid_tensor(ins[1], sz) and _valid_tensor(outs[0], sy)


def _info_case(rng) -> dict:
    fn = str(rng.choice(["input_name", "output_name", "input_info", "output_info", "symbol_info"]))
    i = int(rng.choice([0, 1, 2, -1, 3, 2**31 - 1, -2**31]))
    return {"op": "info", "fn": fn, "i": i, "null_out": bool(rng.integers(2))}


def _create_case(rng) -> dict:
    return {"op": "create", "threads": int(rng.choice([-1, -7, -2**31, 4097, 2**31 - 1, 100000, 0, 1, 2, 3]))}


def _output_shape_case(rng) -> dict:
    case = _run_case(rng)
    case.update(op="output_shape", i=int(rng.choice([0, 0, 0, 1, -1, 2**31 - 1])),
                shape_null=bool(rng.integers(5) == 0))
    return case


def _profile_case(rng) -> dict:
    return {"op": "profile", "session": str(rng.choice(["live", "live", "null", "destroyed", "foreign"])),
            "capacity": int(rng.choice([-1, 0, 1, 2, 64, 1000])), "null": bool(rng.integers(2))}


def _concurrent_case(rng) -> dict:
    n = int(rng.integers(1, 5))
    return {"op": "concurrent", "n": n, "threads": [int(rng.choice([1, 2])) for _ in range(2)],
            "same_session": bool(rng.integers(2)), "runs": int(rng.integers(5, 40)), "seed": int(rng.integers(2**31))}


_MAKERS = [(_run_case, 6), (_output_shape_case, 2), (_info_case, 2), (_create_case, 1), (_profile_case, 1),
           (_concurrent_case, 1)]


def make_case(rng) -> dict:
    """A random case, drawn by the weights of _MAKERS."""
    weights = np.array([w for _, w in _MAKERS], float)
    maker = _MAKERS[int(rng.choice(len(_MAKERS), p=weights / weights.sum()))][0]
    return maker(rng)


def case_inputs(seed: int, n: int):
    """The input values of a case (the same in the parent and the child)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, C_IN, H, W)).astype(np.float32),
            rng.standard_normal((n, C_OUT, H, W)).astype(np.float32))


def _info_values(case: dict, res: dict):
    """(what a valid, non-NULL *_info call returned, what the fixture says it must return)."""
    if case["fn"] == "symbol_info":
        return res["symbol"], ["N", *PROFILE["N"]]
    shape = (_true_shapes(-1)[0] if case["fn"] == "input_info" and case["i"] == 0 else _true_shapes(-1)[1])
    return [res["dtype"], res["ndim"], res["shape"]], [FLOAT, len(shape), shape]


def judge(case: dict, res: dict, facts: dict):
    """(outcome, message) for a case's result."""
    op = case["op"]
    if "error" in res:
        return WRONG, f"{op}: the worker could not run the case: {res['error']}"
    if op in ("run", "output_shape"):
        valid = _run_valid(case)
        if op == "output_shape":
            # output_shape reads no data: only the session, the index, the shape pointer and the input shapes
            ins = case["inputs"]
            n = ins[0]["shape"][0] if ins and ins[0]["shape"] else -1
            valid = (case["session"] == "live" and case["i"] == 0 and not case["shape_null"] and ins is not None
                     and PROFILE["N"][0] <= n <= PROFILE["N"][2]
                     and all(t["dtype"] == FLOAT and t["ndim"] == 4 and t["shape"] == s
                             for t, s in zip(ins, _true_shapes(n)[:2])))
        for rc in res["rcs"]:
            if valid and rc != 0:
                return WRONG, f"{op}: a valid call returned {rc}: {res.get('detail', '')}"
            if not valid and rc == 0:
                return WRONG, f"{op}: an invalid call returned 0 ({json.dumps(case)[:300]})"
            if rc != 0 and rc not in DOCUMENTED_CODES:
                return WRONG, f"{op}: undocumented code {rc}"
        if op == "run" and not res["inputs_intact"]:
            return WRONG, f"run: a call wrote into an input ({res['rcs']})"
        if not valid:
            if not res.get("untouched", True):
                return WRONG, f"{op}: a refused call wrote into an output ({res['rcs']})"
            return CLEAN_ERROR, ""
        if op == "output_shape":
            want = _true_shapes(case["inputs"][0]["shape"][0])[2]
            return (ACCEPTED, "") if res["shape"] == want else (WRONG, f"output_shape gave {res['shape']}, not {want}")
        if not res["tail_intact"]:
            return WRONG, "run: wrote past the end of its output"
        x, z = case_inputs(case["seed"], case["inputs"][0]["shape"][0])
        got = np.array(res["y"], np.float64).reshape(_true_shapes(x.shape[0])[2])
        if not np.allclose(got, reference(x, z), rtol=1e-4, atol=1e-4):
            return WRONG, f"run: output differs from the reference by {np.abs(got - reference(x, z)).max():.3g}"
        return ACCEPTED, ""
    if op == "info":
        count = {"input": 2, "output": 1, "symbol": 1}[case["fn"].split("_")[0]]
        valid = 0 <= case["i"] < count
        if case["fn"].endswith("_name"):
            names = {"input_name": ["x", "z"], "output_name": ["y"]}[case["fn"]]
            ok = res["name"] == (names[case["i"]] if valid else None)
            return (ACCEPTED if valid else CLEAN_ERROR, "") if ok else (WRONG, f"{case['fn']}({case['i']}) = {res['name']}")
        rc = res["rcs"][0]
        if valid != (rc == 0) or (rc != 0 and rc not in DOCUMENTED_CODES):
            return WRONG, f"{case['fn']}({case['i']}) returned {rc}"
        if valid and not case["null_out"]:
            got, want = _info_values(case, res)
            if got != want:
                return WRONG, f"{case['fn']}({case['i']}) gave {got}, not {want}"
        return (ACCEPTED, "") if valid else (CLEAN_ERROR, "")
    if op == "create":
        valid = 0 <= case["threads"] <= 4096
        if res["created"] != valid:
            return WRONG, f"session_create({case['threads']}) {'failed' if valid else 'succeeded'}: {res.get('detail')}"
        return (ACCEPTED, "") if valid else (CLEAN_ERROR, "")
    if op == "profile":
        total = facts["steps"]
        live = case["session"] == "live"
        valid = live and (case["null"] or case["capacity"] >= total)
        rc = res["rcs"][0]
        if (valid and rc != total) or (not valid and (rc >= 0 or rc not in DOCUMENTED_CODES)):
            return WRONG, f"profile({case}) returned {rc}"
        return (ACCEPTED, "") if valid else (CLEAN_ERROR, "")
    if op == "concurrent":
        x, z = case_inputs(case["seed"], case["n"])
        ref = reference(x, z)
        if len(res["rcs"]) != len(case["threads"]) * case["runs"]:
            return WRONG, f"concurrent: {len(res['rcs'])} of {len(case['threads']) * case['runs']} runs reported"
        if 0 not in res["rcs"]:                      # a busy run means another one was running: it succeeded
            return WRONG, f"concurrent: no run succeeded ({sorted(set(res['rcs']))})"
        for rc, y in zip(res["rcs"], res["ys"]):
            if rc == 0:
                if not np.allclose(np.array(y, np.float64).reshape(ref.shape), ref, rtol=1e-4, atol=1e-4):
                    return WRONG, "concurrent: a run's output differs from the reference"
            elif not (case["same_session"] and rc == -13):
                return WRONG, f"concurrent: a run returned {rc}"
            elif y is not None:
                return WRONG, "concurrent: a busy run wrote into its output"
        return ACCEPTED, ""
    return WRONG, f"unknown case op {op!r}"


# -- the child ---------------------------------------------------------------------------------------


class _CTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64))]


class _Worker:
    """Makes the calls a case describes, on one library, in this process."""

    def __init__(self, lib_path: str):
        lib = ctypes.CDLL(lib_path)
        vp, tp = ctypes.c_void_p, ctypes.POINTER(_CTensor)
        i32p, i64p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
        sigs = {"session_create": (vp, [ctypes.c_int]), "session_destroy": (None, [vp]),
                "run": (ctypes.c_int, [vp, tp, tp]), "output_shape": (ctypes.c_int, [vp, tp, ctypes.c_int, i64p]),
                "input_name": (ctypes.c_char_p, [ctypes.c_int]), "output_name": (ctypes.c_char_p, [ctypes.c_int]),
                "input_info": (ctypes.c_int, [ctypes.c_int, i32p, i32p, i64p]),
                "output_info": (ctypes.c_int, [ctypes.c_int, i32p, i32p, i64p]),
                "symbol_info": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), i64p, i64p, i64p]),
                "profile": (ctypes.c_int, [vp, i64p, ctypes.c_int32]), "last_error": (ctypes.c_char_p, [])}
        for name, (res, args) in sigs.items():
            f = getattr(lib, f"cuvil_{name}")
            f.restype, f.argtypes = res, args
            setattr(self, name, f)
        self.junk = np.zeros(4096, np.uint8)

    def facts(self) -> dict:
        s = self.session_create(1)
        steps = self.profile(s, None, 0)
        self.session_destroy(s)
        return {"steps": steps}

    def session(self, kind: str, threads: int = 1):
        """A session handle of the kind a case asks for, and whether the caller must destroy it."""
        if kind == "null":
            return None, False
        if kind == "foreign":
            return int(np.random.default_rng(threads).integers(1, 2**63)), False
        if kind == "foreign_heap":
            return self.junk.ctypes.data, False
        s = self.session_create(threads)
        if not s:
            raise RuntimeError(f"session_create({threads}) failed: {self.last_error()}")
        if kind in ("destroyed", "double"):
            self.session_destroy(s)
            if kind == "double":
                self.session_destroy(s)
            return s, False
        return s, True

    def tensors(self, specs, values, keep):
        """A cuvil_tensor array for specs (None: NULL); buffers sized for what each claims, when that is small."""
        if specs is None:
            return None, []
        arr = (_CTensor * len(specs))()
        bufs = []
        for t, spec in zip(arr, specs):
            shape = spec["shape"]
            claimed = 4
            for v in shape or []:
                claimed = claimed * v if 0 <= v and claimed <= MAX_BUFFER else MAX_BUFFER + 1
            nbytes = claimed if 0 <= claimed <= MAX_BUFFER else 4096
            buf = np.full(nbytes // 4 + 2, np.frombuffer(bytes([SENTINEL] * 4), np.float32)[0], np.float32)
            v = values.get(spec["role"])
            if v is not None and v.nbytes <= nbytes:
                buf[:v.size] = v.ravel()
            bufs.append(buf)
            keep.append(buf)
            if shape is not None:
                cshape = (ctypes.c_int64 * max(1, len(shape)))(*shape)
                keep.append(cshape)
                t.shape = cshape
            t.dtype, t.ndim = spec["dtype"], spec["ndim"]
            t.data = {"ok": buf.ctypes.data, "null": None, "misaligned": buf.ctypes.data + 2}.get(spec["data"], buf.ctypes.data)
        return arr, bufs

    def do(self, case: dict) -> dict:
        op = case["op"]
        if op in ("run", "output_shape"):
            n = next((t["shape"][0] for t in (case["inputs"] or []) if t["shape"]), 1)
            x, z = case_inputs(case["seed"], max(1, min(int(n), 4)) if isinstance(n, int) else 1)
            keep = []
            ins, in_bufs = self.tensors(case["inputs"], {"x": x, "z": z}, keep)
            outs, out_bufs = self.tensors(case["outputs"], {}, keep)
            if outs is not None and case["inputs"] is not None:
                for t, spec in zip(outs, case["outputs"]):
                    if spec["data"].startswith("alias_"):
                        t.data = in_bufs[{"alias_x": 0, "alias_z": 1}[spec["data"]]].ctypes.data
            before = [b.copy() for b in in_bufs]
            s, owned = self.session(case["session"], case.get("threads", 1))
            try:
                if op == "output_shape":
                    shape = (ctypes.c_int64 * 4)()
                    rc = self.output_shape(s, ins, case["i"], None if case["shape_null"] else shape)
                    return {"rcs": [rc], "shape": list(shape), "detail": self.last_error().decode("utf-8", "replace")}
                rcs = [self.run(s, ins, outs) for _ in range(case["repeat"])]
                out = {"rcs": rcs, "detail": self.last_error().decode("utf-8", "replace"),
                       "inputs_intact": all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
                                            for a, b in zip(before, in_bufs))}
                if out_bufs:
                    raw = out_bufs[0].view(np.uint8)
                    out["untouched"] = bool((raw == SENTINEL).all())
                    if rcs and rcs[-1] == 0 and case["outputs"][0]["shape"]:
                        size = int(np.prod(case["outputs"][0]["shape"]))
                        out["y"] = out_bufs[0][:size].astype(float).tolist()
                        out["tail_intact"] = bool((out_bufs[0][size:].view(np.uint8) == SENTINEL).all())
                return out
            finally:
                if owned:
                    self.session_destroy(s)
        if op == "info":
            fn, i = case["fn"], case["i"]
            if fn.endswith("_name"):
                name = getattr(self, fn)(i)
                return {"name": None if name is None else name.decode("utf-8", "replace")}
            if fn == "symbol_info":
                name, lo, opt, hi = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
                args = (None,) * 4 if case["null_out"] else (ctypes.byref(name), ctypes.byref(lo), ctypes.byref(opt),
                                                              ctypes.byref(hi))
                rc = self.symbol_info(i, *args)
                return {"rcs": [rc], "symbol": [None if name.value is None else name.value.decode("utf-8", "replace"),
                                                lo.value, opt.value, hi.value]}
            dt, nd, shape = ctypes.c_int32(), ctypes.c_int32(), (ctypes.c_int64 * 8)()
            args = (None, None, None) if case["null_out"] else (ctypes.byref(dt), ctypes.byref(nd), shape)
            rc = getattr(self, fn)(i, *args)
            return {"rcs": [rc], "dtype": dt.value, "ndim": nd.value, "shape": list(shape)[:max(0, min(8, nd.value))]}
        if op == "create":
            s = self.session_create(case["threads"])
            detail = self.last_error().decode("utf-8", "replace")
            if s:
                self.session_destroy(s)
            return {"created": bool(s), "detail": detail}
        if op == "profile":
            s, owned = self.session(case["session"])
            try:
                acc = (ctypes.c_int64 * max(1, case["capacity"]))()
                return {"rcs": [self.profile(s, None if case["null"] else acc, case["capacity"])]}
            finally:
                if owned:
                    self.profile(s, None, 0)
                    self.session_destroy(s)
        if op == "concurrent":
            return self.concurrent(case)
        return {"error": f"unknown op {op!r}"}

    def concurrent(self, case: dict) -> dict:
        n = case["n"]
        x, z = case_inputs(case["seed"], n)
        if case["same_session"]:
            s = self.session_create(case["threads"][0])
            sessions = [s, s]
        else:
            sessions = [self.session_create(t) for t in case["threads"]]
        rcs, ys, lock = [], [], threading.Lock()

        def worker(s):
            keep = []
            for _ in range(case["runs"]):
                spec = [_tensor(FLOAT, sh, r) for sh, r in zip(_true_shapes(n), ("x", "z", "y"))]
                ins, _ = self.tensors(spec[:2], {"x": x, "z": z}, keep)
                outs, obufs = self.tensors(spec[2:], {}, keep)
                rc = self.run(s, ins, outs)
                y = None
                if rc == 0:
                    y = obufs[0][:x.shape[0] * C_OUT * H * W].astype(float).tolist()
                elif not (obufs[0].view(np.uint8) == SENTINEL).all():
                    y = "touched"
                with lock:
                    rcs.append(rc)
                    ys.append(y)
                keep.clear()
        ts = [threading.Thread(target=worker, args=(s,)) for s in sessions]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for s in dict.fromkeys(sessions):
            self.session_destroy(s)
        return {"rcs": rcs, "ys": ys}


def worker_main(lib_path: str) -> None:
    """The child: one JSON case per line on stdin, one JSON result per line on stdout."""
    w = _Worker(lib_path)
    out = sys.stdout
    out.write(json.dumps({"facts": w.facts()}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            res = w.do(json.loads(line))
        except Exception as e:  # noqa: BLE001 - reported to the parent as a WRONG case, never swallowed
            res = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(res) + "\n")
        out.flush()


# -- the parent --------------------------------------------------------------------------------------


class _Child:
    """A worker process; restarted after a crash or a hang."""

    def __init__(self, lib_path: str):
        env = dict(os.environ)
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        self.err = tempfile.TemporaryFile(mode="w+")      # a pipe could fill up and stall the child
        self.proc = subprocess.Popen([sys.executable, "-m", "cuvil.fuzz.c_abi", "--worker", lib_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     env=env, text=True, bufsize=1)
        first = self.read(120.0)
        if first is None or "facts" not in first:
            err = self.kill()
            raise RuntimeError(f"the C ABI fuzz worker did not start: {err}")
        self.facts = first["facts"]

    def read(self, timeout: float):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"eof": True}

    def kill(self) -> str:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.seek(0)
        err = self.err.read().strip()
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            f.close()
        return err.splitlines()[-1] if err else f"exit {self.proc.returncode}"


def run(budget: int, seed: int, *, timeout_s: float = CASE_SECONDS, progress=None) -> FamilyReport:
    """``budget`` random cases from ``seed`` against a freshly compiled fixture library; a case is a hang after
    ``timeout_s``; ``progress(report)`` every 500 cases (the interface of the other families' ``run``)."""
    report = FamilyReport(FAMILY)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cuvil-fuzz-cabi-") as tmp:
        lib = build_fixture(tmp)
        child = _Child(lib)
        try:
            for k in range(budget):
                case_seed = seed * 1_000_003 + k
                case = make_case(np.random.default_rng(case_seed))
                try:
                    child.proc.stdin.write(json.dumps(case) + "\n")
                    child.proc.stdin.flush()
                    res = child.read(timeout_s)
                except (BrokenPipeError, OSError):
                    res = {"eof": True}
                if res is None or "eof" in res:
                    why = child.kill()
                    outcome = HANG if res is None else CRASH
                    report.add(outcome, case_seed, f"{case['op']}: {why}: {json.dumps(case)[:300]}")
                    child = _Child(lib)
                    continue
                outcome, msg = judge(case, res, child.facts)
                report.add(outcome, case_seed, msg)
                if progress is not None and (k + 1) % 500 == 0:
                    report.seconds = time.perf_counter() - t0
                    progress(report)
        finally:
            child.kill()
    report.seconds = time.perf_counter() - t0
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="LIB", help="run as the child process on LIB")
    ap.add_argument("--budget", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    rep = run(args.budget, args.seed)
    print(json.dumps(rep.to_json(), indent=1))
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
