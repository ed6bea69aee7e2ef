"""``cuvil bench``: latency, throughput, error rate, cold start and peak memory of a compiled model, optionally
beside onnxruntime, judged against an SLA.

    from cuvil.bench import BenchOptions, run_benchmark, load_config
    res = run_benchmark(BenchOptions(model="net.onnx", vs="onnxruntime", threads=1, runs=50))
    res["cuvil"]["p99_ms"], res["ratios"]["p50"]

What is measured (the same in ``cuvil bench`` and ``bench/run_all.py``):

- latency: each timed run alone (``time.perf_counter`` around one ``Model.run`` / ``InferenceSession.run``),
  after ``warmup`` untimed runs per engine and worker. With ``--vs onnxruntime`` the engines alternate run
  by run (the order swaps every iteration) so that machine noise hits both alike.
- throughput: for each concurrent worker, its completed runs of the engine / the time it spent in them,
  summed over the workers (inferences per second).
- error rate: failed runs / attempted runs. With ``--vs``, outputs are compared once (after the warm-up);
  since every run gets the same inputs, a mismatch makes every timed Cuvil run count as an error.
- cold start: in a fresh ``python -c`` subprocess that has imported only ``ctypes`` and ``numpy``: the wall
  time of dlopen + session create + the first run through the C ABI (a minimal ctypes path, not
  ``cuvil.load``: importing the ``cuvil`` package pulls in onnx). For onnxruntime, another fresh process
  that has imported ``onnxruntime`` and ``numpy``: ``InferenceSession`` create + the first run. Both run with
  ``OPENBLAS_NUM_THREADS=1``: the harness's numpy only loads the inputs, and its OpenBLAS thread otherwise
  spins for ~110 ms after ``import numpy`` (CPU time of a process that imports numpy and sleeps: 176 ms,
  65 ms with the variable: ``python3 -c "import numpy, time, resource; time.sleep(.5);
  r = resource.getrusage(0); print(r.ru_utime + r.ru_stime)"`` with and without it), taking the second core
  from whatever runs then. Cuvil's ResNet-50 cold start at
  2 threads was 36.9 ms with it spinning, 21.3 ms without (onnxruntime's import outlasts the spin).
- peak RSS: the peak resident set (``VmHWM`` of ``/proc/self/status``; ``ru_maxrss`` where that is missing)
  of those subprocesses after their first run: absolute, interpreter and numpy included (the report also
  gives a bare ``python + numpy`` process's figure). Not ``ru_maxrss`` itself: Linux carries the parent's
  high-water mark across fork + exec into the child's ``ru_maxrss``.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import yaml

from .artifact import load
from .errors import CuvilError
from .ir.dim import evaluate
from .ir.shape_binding import lookup_symbol
from .pipeline import Pipeline
from .progress import enabled as progress_enabled
from .progress import stage
from .targets.x86.cpu import host_cpu

#: Outputs agree when max |cuvil - ort| <= AGREE_RTOL x max(max |ort|, 1) (the tolerance of
#: ``cuvil.verify.NATIVE_RTOL``: native kernels reassociate reductions and contract multiply-adds).
AGREE_RTOL = 1e-4

DEFAULT_RUNS = 100
DEFAULT_WARMUP = 5
DEFAULT_COLD_RUNS = 3
COLD_TIMEOUT_S = 600


class ConfigError(CuvilError):
    """A malformed or invalid SLA config; the message starts with ``file:line:``."""

    default_hint = "fix that line of the config (bench/sla.yaml shows every key and SLA)"


# -- durations and the config file -------------------------------------------------------------------

_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|m|h)?\s*\Z")
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value) -> float:
    """Seconds from a number (seconds) or a string ``10s``, ``500ms``, ``2m``, ``1h``, ``1.5``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        secs = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"not a duration: {value!r} (use a number of seconds or e.g. 10s, 500ms, 2m)")
        secs = float(m.group(1)) * _UNIT[m.group(2)]
    if not secs > 0 or math.isinf(secs):
        raise ValueError(f"a duration must be positive and finite, got {value!r}")
    return secs


def parse_config_text(text: str, path: str = "<config>") -> tuple[Any, dict[tuple, int]]:
    """One YAML document (PyYAML's safe loader) and the line of every mapping key: ``(data, lines)``, where
    ``lines`` maps each key path (a tuple) to its line number. A YAML error or a key given twice in one
    mapping (which YAML forbids but PyYAML would let the last one win) is a ConfigError ``path:line: message``."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        lines: dict[tuple, int] = {}
        if node is not None:
            _key_lines(loader, node, (), lines, path)
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f"{mark.line + 1}" if mark is not None else "1"
        problem = e.problem or e.context or str(e).splitlines()[0]
        if e.problem and e.context and e.context_mark is not None:
            problem += f" ({e.context} at line {e.context_mark.line + 1})"
        raise ConfigError(f"{path}:{line}: {problem}") from None
    except yaml.reader.ReaderError as e:   # a character YAML does not allow; it has a position, not a mark
        raise ConfigError(f"{path}:{text.count(chr(10), 0, e.position) + 1}: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{path}:1: the config is nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, lines


def _key_lines(loader, node, prefix: tuple, lines: dict[tuple, int], path: str) -> None:
    # Two levels are all a config has (its keys, and the SLAs under `slas`): deeper values are rejected by
    # validation, and walking no deeper keeps aliases of aliases from multiplying the walk.
    if not isinstance(node, yaml.MappingNode) or len(prefix) == 2:
        return
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            continue   # a collection as a key: no config key is one, validation rejects it
        key = prefix + (loader.construct_object(key_node),)
        line = key_node.start_mark.line + 1
        if key in lines:
            raise ConfigError(f"{path}:{line}: duplicate key {'.'.join(map(str, key))!r} (first at line {lines[key]})")
        lines[key] = line
        _key_lines(loader, value_node, key, lines, path)


#: SLA keys: (figure path in the result, "max" = the figure must be at most the limit, "min" = at least).
SLA_KEYS = {
    "p50_latency_ms": (("cuvil", "p50_ms"), "max"),
    "p90_latency_ms": (("cuvil", "p90_ms"), "max"),
    "p99_latency_ms": (("cuvil", "p99_ms"), "max"),
    "max_latency_ms": (("cuvil", "max_ms"), "max"),
    "mean_latency_ms": (("cuvil", "mean_ms"), "max"),
    "error_rate_pct": (("cuvil", "error_rate_pct"), "max"),
    "min_throughput_ips": (("cuvil", "throughput_ips"), "min"),
    "cold_start_ms": (("cuvil", "cold_start_ms"), "max"),
    "peak_rss_mb": (("cuvil", "peak_rss_mb"), "max"),
    "p50_ratio": (("ratios", "p50"), "max"),
    "p99_ratio": (("ratios", "p99"), "max"),
    "cold_start_ratio": (("ratios", "cold_start"), "max"),
    "peak_rss_ratio": (("ratios", "peak_rss"), "max"),
}
_NEEDS_VS = {"p50_ratio", "p99_ratio", "cold_start_ratio", "peak_rss_ratio"}
_NEEDS_COLD = {"cold_start_ms", "peak_rss_mb", "cold_start_ratio", "peak_rss_ratio"}

CONFIG_KEYS = ("concurrency", "duration", "runs", "warmup", "threads", "opt_level", "vs", "slas")


def _number(value, where: str, key: str) -> float:
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    try:
        x = float(value)  # PyYAML reads 1e-6 (no dot) as a string
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}") from None
    if math.isnan(x):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    return x


def _int(value, where: str, key: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    if value < lo:
        raise ConfigError(f"{where}: {key} must be >= {lo}, got {value}")
    return value


def validate_config(data, lines: dict[tuple, int], path: str = "<config>") -> dict[str, Any]:
    """Checks a parsed config; returns ``{"concurrency": int, "duration": seconds, "runs": int, "warmup": int,
    "threads": int, "opt_level": "O3", "vs": str, "slas": {name: float}}`` (only the keys given)."""
    at = lambda *key: f"{path}:{lines.get(key, 1)}"
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: the config must be a mapping of keys to values, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        where = at(key)
        if key not in CONFIG_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(CONFIG_KEYS)})")
        if key == "slas":
            if value is None:
                value = {}
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: slas must be a mapping of SLA names to limits")
            slas = {}
            for name, limit in value.items():
                w = at("slas", name)
                if name not in SLA_KEYS:
                    raise ConfigError(f"{w}: unknown SLA {name!r} (known: {', '.join(SLA_KEYS)})")
                slas[name] = _number(limit, w, f"slas.{name}")
            out["slas"] = slas
        elif key == "duration":
            try:
                out["duration"] = parse_duration(value)
            except ValueError as e:
                raise ConfigError(f"{where}: duration: {e}") from None
        elif key in ("concurrency", "runs"):
            out[key] = _int(value, where, key, 1)
        elif key in ("warmup", "threads"):
            out[key] = _int(value, where, key, 0)
        elif key == "opt_level":
            try:
                out[key] = f"O{parse_opt_level(value)}"
            except CuvilError as e:
                raise ConfigError(f"{where}: {e}") from None
        elif key == "vs":
            if value not in ("onnxruntime", None, False):
                raise ConfigError(f"{where}: vs must be onnxruntime, got {value!r}")
            out[key] = value or None
    if "runs" in out and "duration" in out:
        raise ConfigError(f"{at('duration')}: give runs or duration, not both")
    return out


def load_config(path: str) -> dict[str, Any]:
    """Reads and validates an SLA config file (see :func:`validate_config`)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config: {e.strerror or e}") from None
    data, lines = parse_config_text(text, path)
    return validate_config(data, lines, path)


def parse_opt_level(value) -> int:
    s = str(value).upper()
    level = {"O0": 0, "O1": 1, "O2": 2, "O3": 3, "0": 0, "1": 1, "2": 2, "3": 3}.get(s)
    if level is None or isinstance(value, bool):
        raise CuvilError(f"opt level must be O0, O1, O2 or O3, got {value!r}", hint="give -O O3 (or 0..3)")
    return level


def parse_shapes(items) -> dict[str, Any]:
    """``--shape N=8`` (a symbol) or ``--shape input=1x3x224x224`` (an input's whole shape)."""
    out: dict[str, Any] = {}
    for item in items or ():
        name, _, spec = item.partition("=")
        parts = spec.lower().split("x") if spec else []
        if not name or not parts or not all(p.isdigit() for p in parts):
            raise CuvilError(f"--shape {item!r} is neither NAME=DIM nor INPUT=D0xD1x...",
                             hint="give --fix NAME=DIM (a symbol) or --input-shape INPUT=D0xD1x... (an input's shape)")
        out[name] = int(parts[0]) if len(parts) == 1 else tuple(int(p) for p in parts)
    return out


# -- options and inputs ----------------------------------------------------------------------------

class BenchOptions:
    """What to benchmark and how. ``model`` is an .onnx (compiled first) or a .so (loaded); ``onnx`` the
    ONNX model onnxruntime runs (default: ``model`` when it is one). ``shapes``: a symbol's size by name
    (``{"N": 8}``) or an input's shape (``{"x": (1, 3, 224, 224)}``, or three shapes min, opt, max for an .onnx);
    ``shape_profiles``: a symbol's range by name (``{"N": (1, 8, 64)}``, an .onnx only: compiled for the range,
    timed at its opt). ``runs`` or ``duration`` (seconds); ``threads`` 0 = all cores (the default; onnxruntime
    gets the same count); ``cold_runs`` fresh subprocesses per engine for cold start and peak RSS
    (0 = skip; the median time and the largest RSS are reported); ``progress``: True shows the compile stages
    and the timed runs on stderr (:mod:`cuvil.progress`; "auto" means the same), False hides them, None leaves
    it to the caller's ``cuvil.progress.enabled()`` (off outside one). ``pause_ms``: an untimed sleep after
    every timed run, so that one engine's spinning worker threads have gone idle before the next run starts
    (both runtimes spin for a while after a run; on a machine with few cores, back-to-back alternation makes
    each engine's spinners compete with the other engine's run)."""

    def __init__(self, model: str, *, onnx: str | None = None, vs: str | None = None, threads: int = 0,
                 runs: int | None = None, duration: float | None = None, warmup: int = DEFAULT_WARMUP,
                 concurrency: int = 1, opt_level: int = 3, shapes: dict[str, Any] | None = None, seed: int = 0,
                 cold_runs: int = DEFAULT_COLD_RUNS, rtol: float = AGREE_RTOL, progress: bool | str | None = None,
                 pause_ms: float = 0.0, log=None, shape_profiles: dict[str, Any] | None = None,
                 spelled: dict[str, str] | None = None, peers: dict[str, Any] | None = None):
        self.model, self.onnx, self.vs = model, onnx, vs
        # more engines in the same alternating loop: name -> make(onnx_path, threads, input_names, arrays),
        # which returns a no-argument callable that runs one inference (bench/run_all.py adds OpenVINO)
        self.peers = dict(peers or {})
        self.threads, self.runs, self.duration, self.warmup = threads, runs, duration, warmup
        self.concurrency, self.opt_level, self.shapes, self.seed = concurrency, opt_level, dict(shapes or {}), seed
        self.shape_profiles = dict(shape_profiles or {})
        self.spelled = dict(spelled or {})   # name -> the flag that gave it (--fix, --shape), for errors
        self.cold_runs, self.rtol, self.progress, self.pause_ms = cold_runs, rtol, progress, pause_ms
        self.log = log or (lambda msg: None)
        if runs is None and duration is None:
            self.runs = DEFAULT_RUNS


def _resolve_threads(n: int) -> int:
    if n > 0:
        return n
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _manifest(so_path: str) -> dict:
    base = so_path.removesuffix(".so")
    try:
        with open(base + ".manifest.json", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def is_profile(spec) -> bool:
    """Whether a ``--input-shape`` value is three shapes (min, opt, max) rather than one."""
    return isinstance(spec, tuple) and bool(spec) and isinstance(spec[0], tuple)


def _input_shapes(model, manifest: dict, shapes: dict[str, Any], spelled: dict[str, str] | None = None) -> list[tuple]:
    """Concrete shapes of a loaded library's inputs; symbolic dims from ``--fix``/``--input-shape`` (or their
    old spelling ``--shape``), else the opt value of the library's profile. ``spelled``: the flag that gave
    each name, for errors."""
    spelled = spelled or {}
    declared = {d.get("name"): d.get("shape") for d in manifest.get("inputs", []) if isinstance(d, dict)}
    out = []
    for spec in model.inputs:
        given = shapes.get(spec.name)
        if isinstance(given, tuple):
            if len(given) != spec.ndim or any(v is not None and v != g for v, g in zip(spec.shape, given)):
                fit = "x".join(str(v if v is not None else g) for v, g in zip(spec.shape, given)) \
                    if len(given) == spec.ndim else "x".join(str(v or "D") for v in spec.shape)
                raise CuvilError(f"{spelled.get(spec.name, '--input-shape')} {spec.name}={'x'.join(map(str, given))} "
                                 f"does not fit the library's input {spec.name}: {list(spec.shape)}",
                                 hint=f"--input-shape {spec.name}={fit}")
            out.append(given)
            continue
        dims = []
        for k, v in enumerate(spec.shape):
            if v is not None:
                dims.append(v)
                continue
            decl = declared.get(spec.name)
            sym = decl[k] if isinstance(decl, list) and k < len(decl) else None
            profile = (manifest.get("symbols") or {}).get(sym) if isinstance(sym, str) else None
            if isinstance(sym, str) and isinstance(shapes.get(sym), int):
                dims.append(shapes[sym])
            elif isinstance(profile, dict) and isinstance(profile.get("opt"), int):
                dims.append(profile["opt"])   # the library's opt point unless --shape says otherwise
            else:
                raise CuvilError(f"input {spec.name!r} has a symbolic dim {k} ({sym or '?'}) and no size to time",
                                 hint=(f"--fix {sym}=DIM or " if isinstance(sym, str) else "") + f"--input-shape "
                                      f"{spec.name}=" + "x".join(str(d or "D") for d in spec.shape))
        out.append(tuple(dims))
    return out


def random_inputs(model, shapes: list[tuple], seed: int = 0) -> list[np.ndarray]:
    """Seeded random data: standard normal floats, integers in [0, 4), random bools."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec, shape in zip(model.inputs, shapes):
        dt = spec.dtype
        if dt is None:
            raise CuvilError(f"input {spec.name!r} has dtype code {spec.code}, which numpy cannot hold",
                             hint="time it from C (examples/c), or export the model with a numeric input type")
        if dt.kind == "f":
            a = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "c":
            a = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
        elif dt.kind == "b":
            a = rng.integers(0, 2, size=shape).astype(dt)
        elif dt.kind in "iu":
            a = rng.integers(0, 4, size=shape).astype(dt)
        else:
            raise CuvilError(f"input {spec.name!r}: cannot make random data of dtype {dt}",
                             hint="time it from C (examples/c) with your own data")
        arrays.append(np.ascontiguousarray(a))
    return arrays


def prepare_library(opts: BenchOptions) -> dict[str, Any]:
    """Compiles ``opts.model`` (an .onnx) or checks the .so; returns {"library", "onnx", "compiled": {...}}."""
    path = opts.model
    if not os.path.isfile(path):
        raise CuvilError(f"{path}: no such file", hint="give an .onnx model or a compiled libNAME.so")
    if path.endswith(".so"):
        onnx_path = opts.onnx
        if opts.vs and not onnx_path:
            raise CuvilError(f"--vs {opts.vs} with a compiled library needs the ONNX model it came from",
                             hint="add --onnx MODEL.onnx")
        if onnx_path and not os.path.isfile(onnx_path):
            raise CuvilError(f"{onnx_path}: no such file", hint="give --onnx the model the library was compiled from")
        if opts.shape_profiles:
            name = next(iter(opts.shape_profiles))
            raise CuvilError(f"--shape-profile {name}: a compiled library's profile was set when it was compiled",
                             hint=f"give one size to time: --fix {name}=SIZE, or bench the .onnx with --shape-profile")
        for name, spec in opts.shapes.items():
            if is_profile(spec):
                raise CuvilError(f"--input-shape {name}=MIN:OPT:MAX: a compiled library's profile was set when it "
                                 f"was compiled", hint=f"give the one shape to time: --input-shape {name}="
                                 + "x".join(map(str, spec[1])))
        return {"library": os.path.abspath(path), "onnx": onnx_path, "compiled": None}
    t0 = time.perf_counter()
    opts.log(f"compiling {path} at O{opts.opt_level}")
    p = Pipeline.from_onnx(path).optimize()
    symbols = dict(p.graph.symbols)
    for name, val in opts.shapes.items():
        if not isinstance(val, tuple):
            lookup_symbol(p.graph, name, f"{opts.spelled.get(name, '--shape')} {name}={val}")
    fixed, profiles = p.resolve_shapes({k: v for k, v in opts.shapes.items() if not isinstance(v, tuple)},
                                       opts.shape_profiles or None,
                                       {k: v for k, v in opts.shapes.items() if isinstance(v, tuple)})
    given = set(fixed) | set(profiles)
    for name, sym in symbols.items():   # a benchmark times one shape: the rest at their opt (else min)
        if name not in profiles:
            fixed.setdefault(name, sym.tuned)
    art = p.compile(opt_level=opts.opt_level, fixed=fixed, shape_profiles=profiles)
    secs = time.perf_counter() - t0
    spec = art.manifest.get("specialized") or {}
    defaulted = sorted(set(spec) - given)
    if defaulted:
        opts.log("symbolic dims set to their opt/min value: " + ", ".join(f"{k}={spec[k]}" for k in defaulted)
                 + " (choose with --fix NAME=DIM or --input-shape INPUT=D0xD1x...)")
    return {"library": art.path, "onnx": opts.onnx or path,
            "compiled": {"cached": art.cached, "seconds": secs, "opt_level": opts.opt_level,
                         "compile_seconds": (art.timings or {}).get("compile_seconds"), "specialized": spec,
                         "flops": _concrete(p.stats().flops, spec)}}


def _concrete(x, env: dict[str, int]) -> int | None:
    """An int, or a symbolic count evaluated at the specialised symbols (None if that fails)."""
    if isinstance(x, int):
        return x
    try:
        return int(evaluate(x, env))
    except Exception:  # noqa: BLE001 - a figure, not a failure
        return None


# -- engines ---------------------------------------------------------------------------------------

def _ort_session(onnx_path: str, threads: int):
    try:
        import onnxruntime as ort
    except ImportError:
        raise CuvilError("--vs onnxruntime needs onnxruntime, which is not installed",
                         hint="pip install onnxruntime (or pip install 'cuvil[bench]')") from None
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])


def _ort_names(sess, names: list[str]) -> list[str]:
    """onnxruntime's input name for each of the library's inputs (by name, else by position)."""
    want = [i.name for i in sess.get_inputs()]
    if sorted(want) == sorted(names):
        return list(names)
    if len(want) == len(names):  # renamed inputs: match by position
        return want
    raise CuvilError(f"onnxruntime's model has inputs {want}, the library {names}",
                     hint="give --onnx the model this library was compiled from")


def compare_outputs(names: list[str], got: list[np.ndarray], ort_names: list[str], want: list[np.ndarray],
                    rtol: float = AGREE_RTOL) -> dict[str, Any]:
    """Max abs and rel error of Cuvil's outputs against onnxruntime's (matched by name, else by position);
    rel = abs error / max(max |reference|, 1)."""
    ref = dict(zip(ort_names, want))
    pairs = [(n, g, ref[n]) for n, g in zip(names, got)] if all(n in ref for n in names) else \
        [(n, g, w) for n, g, w in zip(names, got, want)]
    worst_abs = worst_rel = 0.0
    problems = []
    for n, g, w in pairs:
        if g.shape != w.shape:
            problems.append(f"{n}: shape {list(g.shape)} vs {list(w.shape)}")
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        finite = np.isfinite(w64)
        if (np.isfinite(g64) != finite).any():
            problems.append(f"{n}: non-finite values differ")
        if not finite.any():
            continue
        err = float(np.max(np.abs(g64[finite] - w64[finite]))) if g.size else 0.0
        scale = max(float(np.max(np.abs(w64[finite]))), 1.0)
        worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, err / scale)
    agree = not problems and worst_rel <= rtol
    return {"max_abs_err": worst_abs, "max_rel_err": worst_rel, "rtol": rtol, "agree": agree,
            "problems": problems}


def _stats(lat: list[float], errors: int, attempted: int, busy: list[tuple[int, float]]) -> dict[str, Any]:
    n = len(lat)
    ms = np.asarray(lat) * 1e3
    pct = (lambda q: float(np.percentile(ms, q))) if n else (lambda q: math.nan)
    thr = sum(k / t for k, t in busy if t > 0)
    return {"runs": n, "errors": errors, "error_rate_pct": 100.0 * errors / attempted if attempted else 0.0,
            "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "max_ms": float(ms.max()) if n else math.nan,
            "min_ms": float(ms.min()) if n else math.nan, "mean_ms": float(ms.mean()) if n else math.nan,
            "throughput_ips": thr}


def _timed_phase(opts: BenchOptions, lib: str, onnx_path: str | None, threads: int, arrays, names,
                 ort_agree: dict[str, Any] | None):
    """Warm-up and timed runs in ``opts.concurrency`` threads, each with its own Cuvil Model (own session)
    and, with ``vs``, its own onnxruntime session."""
    engines = ["cuvil"] + (["onnxruntime"] if opts.vs else []) + list(opts.peers)
    workers = []
    for _ in range(opts.concurrency):
        runners = {"cuvil": functools.partial(load(lib, num_threads=threads).run, *arrays)}
        if opts.vs:
            sess = _ort_session(onnx_path, threads)
            feeds = dict(zip(_ort_names(sess, names), arrays))
            runners["onnxruntime"] = functools.partial(sess.run, None, feeds)
        for name, make in opts.peers.items():
            runners[name] = make(onnx_path, threads, names, arrays)
        workers.append(runners)
    out, wall = run_workers(opts, workers, engines)
    if ort_agree is not None and not ort_agree["agree"]:
        s, flat = out["cuvil"]
        s["errors"] += len(flat)  # the same inputs every run: a wrong output is wrong every time
        attempted = s["runs"] + s["errors"] - len(flat)
        s["error_rate_pct"] = 100.0 * s["errors"] / attempted if attempted else 0.0
        s["first_error"] = s["first_error"] or "outputs disagree with onnxruntime"
    return out, wall


def run_workers(opts: BenchOptions, workers: list[dict[str, Any]], engines: list[str]):
    """The timed loop of ``cuvil bench``, for any engine: ``workers[k][engine]`` is a no-argument callable that
    runs one inference (raising on failure) in worker thread ``k``. Each worker runs ``opts.warmup`` untimed
    calls per engine, then all start together and call until ``opts.runs`` calls in all or ``opts.duration``
    seconds, alternating the engines; ``opts.pause_ms`` sleeps after each. Returns ``({engine: (stats,
    latencies_s)}, wall_s)``, the stats as :func:`_stats` (latency percentiles, throughput, error rate) plus
    ``first_error``. ``cuvil bench --url`` (:mod:`cuvil.bench_http`) runs HTTP requests through it."""
    C = len(workers)
    lat = {e: [[] for _ in range(C)] for e in engines}
    errs = {e: [0] * C for e in engines}
    busy = {e: [0.0] * C for e in engines}
    first_error: dict[str, str] = {}
    lock = threading.Lock()
    counter = [0]
    started = threading.Barrier(C + 1)
    state = {"t0": 0.0, "deadline": math.inf}

    stop = getattr(opts, "stop", None)   # a threading.Event that ends the timed loop early (HttpBenchOptions.stop)

    def take() -> bool:
        if stop is not None and stop.is_set():
            return False
        if opts.duration is not None:
            return time.perf_counter() < state["deadline"]
        with lock:
            if counter[0] >= opts.runs:
                return False
            counter[0] += 1
            return True

    pause = opts.pause_ms / 1e3

    def work(k: int) -> None:
        runners = workers[k]
        try:
            for e in engines:
                for _ in range(opts.warmup):
                    try:
                        runners[e]()
                    except Exception:  # noqa: BLE001 - counted in the timed phase
                        break
        finally:
            started.wait()
        it = 0
        while take():
            order = engines if it % 2 == 0 else engines[::-1]
            for e in order:
                t = time.perf_counter()
                try:
                    runners[e]()
                except Exception as ex:  # noqa: BLE001 - a failed run is an error, not a crash
                    dt = time.perf_counter() - t
                    errs[e][k] += 1
                    first_error.setdefault(e, f"{type(ex).__name__}: {ex}")
                else:
                    dt = time.perf_counter() - t
                    lat[e][k].append(dt)
                busy[e][k] += dt
                if pause:
                    time.sleep(pause)
            it += 1

    threads_ = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(C)]
    for t in threads_:
        t.start()
    started.wait()
    state["t0"] = t0 = time.perf_counter()
    if opts.duration is not None:
        state["deadline"] = t0 + opts.duration
    # a duration is counted in whole milliseconds: progress steps are counts
    total = round(opts.duration * 1e3) if opts.duration is not None else opts.runs
    with stage("timing", total=total, unit="ms" if opts.duration is not None else "runs",
               detail=" vs ".join(engines)) as bar:
        shown = 0
        while True:
            alive = [t for t in threads_ if t.is_alive()]
            done = total if not alive else min(total, round((time.perf_counter() - t0) * 1e3)
                                                if opts.duration is not None else counter[0])
            if done > shown:
                bar.advance(done - shown)
                shown = done
            if not alive:
                break
            alive[0].join(timeout=0.05)
    wall = time.perf_counter() - t0
    out = {}
    for e in engines:
        flat = [x for w in lat[e] for x in w]
        errors = attempted = sum(errs[e])
        attempted += len(flat)
        s = _stats(flat, errors, attempted, [(len(lat[e][k]), busy[e][k]) for k in range(C)])
        s["first_error"] = first_error.get(e)
        out[e] = (s, flat)
    return out, wall


# -- cold start and peak RSS in fresh processes ------------------------------------------------------

_PEAK_RSS = r'''
def peak_rss_kb():
    # VmHWM: the peak RSS of this process image. ru_maxrss is not used: Linux carries the parent's high-water
    # mark over fork (vfork) + exec into the child's ru_maxrss, so a child of a big process reads big.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
'''

_CUVIL_COLD = _PEAK_RSS + r'''
import ctypes, json, os, sys, time
import numpy as np
lib_path, prefix, threads, npz = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with np.load(npz) as z:
    xs = [np.ascontiguousarray(z["a%d" % k]) for k in range(len(z.files))]
CODES = {np.dtype(t): c for t, c in (("float32", 1), ("uint8", 2), ("int8", 3), ("uint16", 4), ("int16", 5),
         ("int32", 6), ("int64", 7), ("bool", 9), ("float16", 10), ("float64", 11), ("uint32", 12),
         ("uint64", 13), ("complex64", 14), ("complex128", 15))}
DTYPES = {c: t for t, c in CODES.items()}
class T(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64))]
I32P, I64P, TP = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(T)
t0 = time.perf_counter()
lib = ctypes.CDLL(lib_path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
f = lambda n, res, args: (setattr(getattr(lib, prefix + "_" + n), "restype", res),
                          setattr(getattr(lib, prefix + "_" + n), "argtypes", args), getattr(lib, prefix + "_" + n))[2]
create = f("session_create", ctypes.c_void_p, [ctypes.c_int])
run = f("run", ctypes.c_int, [ctypes.c_void_p, TP, TP])
oinfo = f("output_info", ctypes.c_int, [ctypes.c_int, I32P, I32P, I64P])
oshape = f("output_shape", ctypes.c_int, [ctypes.c_void_p, TP, ctypes.c_int, I64P])
nout = f("num_outputs", ctypes.c_int, [])()
last_error = f("last_error", ctypes.c_char_p, [])
external = hasattr(lib, prefix + "_weights_info") and f("weights_info", ctypes.c_int,
                                                        [ctypes.c_void_p, ctypes.c_void_p])(None, None) == 1
if external:   # plain external weights: map libNAME.weights read-only and shared and bind them, as C programs do
    import mmap
    with open(lib_path[:-3] + ".weights", "rb") as wf:
        wmap = mmap.mmap(wf.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    hb, nb = int.from_bytes(wmap[16:24], "little"), int.from_bytes(wmap[24:32], "little")
    bind = f("bind_weights", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t])
    rc = bind(np.frombuffer(wmap, np.uint8).ctypes.data + hb, nb)
    if rc:
        sys.exit("bind_weights failed (code %d): %s" % (rc, last_error()))
s = create(threads)
if not s:
    sys.exit("session_create failed: %s" % last_error())
ins = (T * max(1, len(xs)))()
keep = []
for t, x in zip(ins, xs):
    sh = (ctypes.c_int64 * max(1, x.ndim))(*x.shape)
    keep.append(sh)
    t.data, t.dtype, t.ndim, t.shape = x.ctypes.data or None, CODES[x.dtype], x.ndim, sh
outs = (T * max(1, nout))()
ys = []
for j in range(nout):
    dt, nd = ctypes.c_int32(), ctypes.c_int32()
    oinfo(j, ctypes.byref(dt), ctypes.byref(nd), None)
    sh = (ctypes.c_int64 * max(1, nd.value))()
    oinfo(j, None, None, sh)
    if any(sh[k] < 0 for k in range(nd.value)):
        oshape(s, ins, j, sh)
    y = np.empty(tuple(sh[k] for k in range(nd.value)), DTYPES[dt.value])
    keep.append(sh)
    ys.append(y)
    outs[j].data, outs[j].dtype, outs[j].ndim, outs[j].shape = y.ctypes.data or None, dt.value, nd.value, sh
rc = run(s, ins, outs)
t1 = time.perf_counter()
if rc:
    sys.exit("run failed (code %d): %s" % (rc, last_error()))
print(json.dumps({"ms": 1e3 * (t1 - t0), "rss_kb": peak_rss_kb(),
                  "sum": float(sum(np.sum(y, dtype=np.float64) for y in ys if y.dtype.kind in "fiub"))}))
'''

_ORT_COLD = _PEAK_RSS + r'''
import json, sys, time
import numpy as np
import onnxruntime as ort
model, threads, npz, names = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
with np.load(npz) as z:
    feeds = {n: z["a%d" % k] for k, n in enumerate(names)}
t0 = time.perf_counter()
so = ort.SessionOptions()
so.intra_op_num_threads = threads
so.inter_op_num_threads = 1
so.log_severity_level = 3
sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
ys = sess.run(None, feeds)
t1 = time.perf_counter()
print(json.dumps({"ms": 1e3 * (t1 - t0), "rss_kb": peak_rss_kb(),
                  "sum": float(sum(np.sum(y, dtype=np.float64) for y in ys if y.dtype.kind in "fiub"))}))
'''

_BASELINE = _PEAK_RSS + r'''
import ctypes, json
import numpy as np
print(json.dumps({"rss_kb": peak_rss_kb()}))
'''


def _subprocess_json(code: str, args: list[str], what: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSTARTUP",)}
    env["OPENBLAS_NUM_THREADS"] = "1"                 # numpy's spinning BLAS thread is the harness's, not the engine's
    try:
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                           timeout=COLD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise CuvilError(f"cold-start measurement of {what} took over {COLD_TIMEOUT_S} s",
                         hint="leave it out (--cold-runs 0), or time a smaller model") from None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise CuvilError(f"cold-start measurement of {what} failed (exit {r.returncode}): {tail[0]}",
                         hint="leave it out (--cold-runs 0); the error above is the child process's")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure_cold(lib: str, prefix: str, onnx_path: str | None, ort_names: list[str] | None,
                 arrays: list[np.ndarray], threads: int, runs: int) -> dict[str, Any]:
    """Cold start and peak RSS of Cuvil (and onnxruntime when ``onnx_path``), ``runs`` fresh processes each,
    alternating; the median time and the largest RSS of each."""
    with tempfile.TemporaryDirectory(prefix="cuvil-bench-") as tmp:
        npz = os.path.join(tmp, "inputs.npz")
        np.savez(npz, **{f"a{k}": a for k, a in enumerate(arrays)})
        res: dict[str, list[dict]] = {"cuvil": [], "onnxruntime": []}
        for _ in range(runs):
            res["cuvil"].append(_subprocess_json(_CUVIL_COLD, [lib, prefix, str(threads), npz], "the Cuvil library"))
            if onnx_path:
                res["onnxruntime"].append(_subprocess_json(
                    _ORT_COLD, [onnx_path, str(threads), npz, json.dumps(ort_names)], "onnxruntime"))
        base = _subprocess_json(_BASELINE, [], "a bare interpreter")
    out: dict[str, Any] = {"runs": runs, "baseline_rss_mb": base["rss_kb"] / 1024}
    for e, rs in res.items():
        if rs:
            out[e] = {"cold_start_ms": float(np.median([r["ms"] for r in rs])),
                      "peak_rss_mb": max(r["rss_kb"] for r in rs) / 1024, "output_sum": rs[0]["sum"]}
    return out


# -- the whole benchmark ---------------------------------------------------------------------------

def _ratio(a, b):
    try:
        return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan
    except TypeError:
        return math.nan


def run_benchmark(opts: BenchOptions) -> dict[str, Any]:
    """Compiles or loads, measures, and returns every figure as a JSON-ready dict (see the module doc)."""
    with progress_enabled(bool(opts.progress)) if opts.progress is not None else contextlib.nullcontext():
        return _run_benchmark(opts)


def _run_benchmark(opts: BenchOptions) -> dict[str, Any]:
    if opts.vs not in (None, "onnxruntime"):
        raise CuvilError(f"--vs takes onnxruntime, got {opts.vs!r}", hint="give --vs onnxruntime, or leave it out")
    if opts.concurrency < 1:
        raise CuvilError(f"--concurrency must be >= 1, got {opts.concurrency}", hint="give --concurrency 1 or more")
    if opts.duration is None and (opts.runs is None or opts.runs < 1):
        raise CuvilError(f"--runs must be >= 1, got {opts.runs}", hint="give --runs 1 or more, or --duration 10s")
    prep = prepare_library(opts)
    lib, onnx_path = prep["library"], prep["onnx"]
    threads = _resolve_threads(opts.threads)
    manifest = _manifest(lib)
    probe = load(lib, num_threads=threads)
    shapes = _input_shapes(probe, manifest, {k: v for k, v in opts.shapes.items() if not is_profile(v)}, opts.spelled)
    arrays = random_inputs(probe, shapes, opts.seed)
    names = [d.name for d in probe.inputs]
    out_names = [d.name for d in probe.outputs]
    result: dict[str, Any] = {
        "model": opts.model, "library": lib, "onnx": onnx_path if opts.vs else None,
        "artifact_bytes": os.path.getsize(lib), "compiled": prep["compiled"],
        "inputs": [{"name": n, "dtype": str(a.dtype), "shape": list(a.shape)} for n, a in zip(names, arrays)],
        "settings": {"threads": threads, "concurrency": opts.concurrency, "warmup": opts.warmup,
                     "runs": opts.runs if opts.duration is None else None, "duration_s": opts.duration,
                     "vs": opts.vs, "opt_level": f"O{opts.opt_level}", "seed": opts.seed, "cold_runs": opts.cold_runs,
                     "pause_ms": opts.pause_ms},
        "host": host_info(),
    }
    agreement = None
    ort_names = None
    if opts.vs:
        sess = _ort_session(onnx_path, threads)
        ort_names = _ort_names(sess, names)
        feeds = dict(zip(ort_names, arrays))
        try:
            got = probe.run(*arrays)
        except CuvilError as e:
            raise CuvilError(f"the library fails on the benchmark inputs: {getattr(e, 'message', e)}",
                             hint=getattr(e, "hint", None) or "run it alone: cuvil run LIB --input-shape ...") from None
        want = sess.run(None, feeds)
        agreement = compare_outputs(out_names, got, [o.name for o in sess.get_outputs()], want, opts.rtol)
        del sess
    probe.close()
    result["agreement"] = agreement
    opts.log(f"timing: {opts.warmup} warm-up runs, then "
             + (f"{opts.duration:g} s" if opts.duration is not None else f"{opts.runs} runs per engine")
             + (" (alternating with onnxruntime)" if opts.vs else "")
             + f", {opts.concurrency} worker(s), {threads} thread(s) each")
    phase, wall = _timed_phase(opts, lib, onnx_path, threads, arrays, names, agreement)
    result["wall_s"] = wall
    result["latencies_ms"] = {e: [1e3 * x for x in flat] for e, (_, flat) in phase.items()}
    for e, (s, _) in phase.items():
        result[e] = s
    cold = None
    if opts.cold_runs > 0:
        opts.log(f"cold start: {opts.cold_runs} fresh process(es) per engine")
        cold = measure_cold(lib, manifest.get("prefix", "cuvil"), onnx_path if opts.vs else None, ort_names,
                            arrays, threads, opts.cold_runs)
        result["baseline_rss_mb"] = cold["baseline_rss_mb"]
        result["cold"] = cold
        for e in ("cuvil", "onnxruntime"):
            if e in cold and e in result:
                result[e]["cold_start_ms"] = cold[e]["cold_start_ms"]
                result[e]["peak_rss_mb"] = cold[e]["peak_rss_mb"]
    if opts.vs:
        c, o = result["cuvil"], result["onnxruntime"]
        result["ratios"] = {"p50": _ratio(c["p50_ms"], o["p50_ms"]), "p99": _ratio(c["p99_ms"], o["p99_ms"]),
                            "throughput": _ratio(c["throughput_ips"], o["throughput_ips"]),
                            "cold_start": _ratio(c.get("cold_start_ms", math.nan), o.get("cold_start_ms", math.nan)),
                            "peak_rss": _ratio(c.get("peak_rss_mb", math.nan), o.get("peak_rss_mb", math.nan))}
    for name in opts.peers:
        result.setdefault("peer_ratios", {})[name] = {"p50": _ratio(result["cuvil"]["p50_ms"], result[name]["p50_ms"])}
    return result


def host_info() -> dict[str, Any]:
    """The machine a benchmark ran on: ``cpu`` (brand string and cpuid family/model/stepping), ``cores``, the
    widest SIMD Cuvil's kernels use (``simd``, ``vector_bits``) and ``fma``, from the ISA features."""
    cpu = host_cpu()
    simd = {512: "avx512f", 256: "avx2"}.get(cpu.vector_bits, "sse")
    return {"cpu": cpu.label(), "cores": _resolve_threads(0), "simd": simd, "fma": "fma" in cpu.features,
            "vector_bits": cpu.vector_bits}


# -- SLAs, report, plot ----------------------------------------------------------------------------

def check_slas(result: dict[str, Any], slas: dict[str, float]) -> list[dict[str, Any]]:
    """One entry per SLA: name, limit, kind (max/min), measured value, held."""
    out = []
    for name, limit in slas.items():
        (section, key), kind = SLA_KEYS[name]
        value = (result.get(section) or {}).get(key, math.nan)
        if value is None:
            value = math.nan
        held = (value <= limit if kind == "max" else value >= limit) if not math.isnan(value) else False
        out.append({"name": name, "limit": limit, "kind": kind, "value": value, "held": bool(held)})
    return out


def sla_requirements(slas: dict[str, float], vs: str | None, cold_runs: int) -> None:
    """Usage errors for SLAs the requested run cannot measure."""
    for name in slas:
        if name not in SLA_KEYS:
            raise CuvilError(f"unknown SLA {name!r}", hint=f"name one of {', '.join(SLA_KEYS)}")
        if name in _NEEDS_VS and not vs:
            raise CuvilError(f"the SLA {name} compares with onnxruntime", hint="add --vs onnxruntime")
        if name in _NEEDS_COLD and cold_runs < 1:
            raise CuvilError(f"the SLA {name} needs the cold-start measurement", hint="give --cold-runs 1 or more")


def _fmt(x, digits=3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.{digits}f}"
    return f"{x:.{digits}g}" if x else "0"


def format_report(result: dict[str, Any], sla_results: list[dict[str, Any]] | None = None) -> str:
    """The human-readable summary ``cuvil bench`` prints."""
    s = result["settings"]
    lines = []
    comp = result.get("compiled")
    src = result["model"]
    how = ""
    if comp:
        how = f" (compiled {s['opt_level']}" + (", cached)" if comp["cached"] else f" in {comp['seconds']:.1f} s)")
    lines.append(f"model      {src}{how}")
    if result.get("url"):   # cuvil bench --url (cuvil.bench_http): requests to a server, not calls of a library
        lines.append(f"server     {result['url']}  (Open Inference Protocol, "
                     + ("binary-data extension)" if s.get("binary_data") else "JSON tensors)"))
    else:
        lines.append(f"library    {result['library']}  ({result['artifact_bytes']:,} bytes)")
    lines.append("inputs     " + ", ".join(f"{i['name']}: {i['dtype']}{i['shape']}" for i in result["inputs"])
                 + f"  (random, seed {s['seed']})")
    amount = f"{s['runs']} timed runs" if s["runs"] is not None else f"{s['duration_s']:g} s"
    if result.get("url"):
        lines.append(f"settings   {s['concurrency']} closed-loop worker(s) (keep-alive), {s['warmup']} warm-up "
                     f"requests each, {amount}; latency = request sent to answer read")
    else:
        lines.append(f"settings   {s['threads']} thread(s), concurrency {s['concurrency']}, {s['warmup']} warm-up "
                     f"runs, {amount}" + (", alternating with onnxruntime run by run" if s["vs"] else ""))
    engines = ["cuvil"] + (["onnxruntime"] if s["vs"] else [])
    head = f"{'':16}" + "".join(f"{e:>14}" for e in engines) + (f"{'ratio':>10}" if s["vs"] else "")
    lines.append("")
    lines.append(head)
    ratios = result.get("ratios") or {}

    def row(label, key, unit="", ratio_key=None):
        vals = [result[e].get(key) for e in engines]
        cells = "".join(f"{_fmt(v) + unit:>14}" for v in vals)
        r = f"{_fmt(ratios.get(ratio_key), 2):>10}" if s["vs"] and ratio_key else ""
        lines.append(f"{label:16}{cells}{r}")

    row("p50 latency", "p50_ms", " ms", "p50")
    row("p90 latency", "p90_ms", " ms")
    row("p99 latency", "p99_ms", " ms", "p99")
    row("max latency", "max_ms", " ms")
    row("throughput", "throughput_ips", " /s", "throughput")
    row("error rate", "error_rate_pct", " %")
    row("runs", "runs")
    if "cold_start_ms" in result["cuvil"]:
        row("cold start", "cold_start_ms", " ms", "cold_start")
        row("peak RSS", "peak_rss_mb", " MiB", "peak_rss")
    lines.append("")
    if "cold_start_ms" in result["cuvil"]:
        lines.append("cold start = fresh process: dlopen + session create + first run (Cuvil, minimal ctypes path)"
                     + (" / InferenceSession create + first run (onnxruntime)" if s["vs"] else "")
                     + f"; peak RSS = that process's peak resident set (python + numpy alone: "
                     f"{result['baseline_rss_mb']:.1f} MiB)")
    for e in engines:
        if result[e].get("first_error"):
            lines.append(f"{e}: first error: {result[e]['first_error']}")
    ag = result.get("agreement")
    if ag:
        verdict = "agree" if ag["agree"] else "DISAGREE"
        lines.append(f"outputs {verdict} with onnxruntime: max abs error {ag['max_abs_err']:.3g}, max rel error "
                     f"{ag['max_rel_err']:.3g} (tolerance {ag['rtol']:g} x max(|ref|, 1))"
                     + ("; " + "; ".join(ag["problems"]) if ag["problems"] else ""))
    if sla_results:
        for r in sla_results:
            op = "<=" if r["kind"] == "max" else ">="
            lines.append(f"SLA {r['name']} {op} {r['limit']:g}: measured {_fmt(r['value'])}  "
                         + ("held" if r["held"] else "NOT HELD"))
        ok = all(r["held"] for r in sla_results)
        lines.append("SLA " + ("held" if ok else "NOT held"))
    return "\n".join(lines)


def _json_safe(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def write_json(result: dict[str, Any], path: str) -> None:
    """All figures, NaN as null."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_safe(result), f, indent=1, default=str)
        f.write("\n")


def require_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CuvilError("--plot needs matplotlib, which is not installed",
                         hint="pip install matplotlib (or pip install 'cuvil[plot]')") from None
    return plt


def plot(result: dict[str, Any], path: str) -> None:
    """Latency histogram and CDF of each engine."""
    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    every = [x for lat in result["latencies_ms"].values() for x in lat]
    edges = np.histogram_bin_edges(every, bins=min(60, max(5, len(every) // 8))) if every else 10
    for e, lat in result["latencies_ms"].items():
        if not lat:
            continue
        xs = np.sort(np.asarray(lat))
        ax1.hist(xs, bins=edges, alpha=0.6, label=e)
        ax2.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=e)
    ax1.set_xlabel("latency (ms)")
    ax1.set_ylabel("runs")
    ax1.set_title("latency histogram")
    ax2.set_xlabel("latency (ms)")
    ax2.set_ylabel("fraction of runs")
    ax2.set_title("latency CDF")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"{os.path.basename(result['model'])}: {result['settings']['threads']} thread(s), "
                 f"concurrency {result['settings']['concurrency']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
