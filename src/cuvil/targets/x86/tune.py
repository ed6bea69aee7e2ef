"""Compile-time tuning (``cuvil compile --tune``, ``compile(tune=True)``): the x86 target measures, on the host,
the schedules it already knows how to generate for each float32 convolution layer, takes the fastest, and
keeps the choice on disk.

* Candidates per layer (:func:`candidates`): the direct convolution with each register tile the target offers
  (AVX-512: 12 x 32, 8 x 48, 6 x 64 position tiles, and the channel-lane 48 x 7, 64 x 6, 32 x 7, 32 x 8 for
  reductions of 128 or more; :func:`cuvil.targets.x86.gemm.tile_shapes`) whose padded work is within
  :data:`PRUNE` of the least, and for a stride-1 3x3 layer Winograd F(2x2) and F(4x4). The cost model's own
  choice is always among them.
* Each candidate is the layer alone (Conv + Relu, the model's shapes and attributes, seeded weights) built
  by the normal pipeline of the target (algorithm choice, :func:`cuvil.targets.x86.compile.compile_x86`) with
  the choice forced through :class:`~cuvil.targets.x86.tuning.X86Tuning`'s ``layer_winograd`` /
  ``layer_tiles``. The libraries of one layer are timed in one child process (a candidate that crashes
  takes the child down, not the compiler; the layer then keeps the cost model's choice), side by side:
  blocks of runs, candidates alternating in order and reverse, the best block per candidate (on a shared
  machine a block that was descheduled says nothing about the code); at one thread in the calling thread's
  CPU time (``time.thread_time``: the library runs a one-thread session on it), which leaves out the time
  the machine gave to other processes.
* Choices are cached in ``$CUVIL_CACHE_DIR/tune/`` (default ``~/.cache/cuvil/tune``), one JSON file per key:
  the CPU as cpuid names it (vendor, brand, family / model / stepping), its ISA features, the layer's shape
  and attributes, the dtype, the thread count timed, the optimisation level and the cuvil version with a
  digest of the code generators' sources. Another CPU, or another build of the kernels, never reuses a
  choice; the same ones make the second compile take no measurement at all (and, the choices being part of
  the library's cache key, hit the artifact cache). An unwritable cache is a warning: the choices are used
  for this build and measured again next time.
* ``tune_budget`` seconds bound the measuring (largest layers first); a layer not reached keeps the cost
  model's choice and is listed as such in the manifest's ``tune`` entry, beside every layer's choice and times.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import attrs
import numpy as np

from ...errors import CuvilError
from ...progress import enabled as progress_enabled
from ...ir.dtype import DType
from ...ir.graph import Graph, Node
from ...ir.types import TensorType
from ...kernels.contraction import channel_lanes, choose_tile, tile_cost
from ...version import __version__
from .cpu import describe_cpu, host_cpu, is_host_name
from .choose import MIN_CHANNELS, best_tile
from .compile import compile_x86
from .gemm import tile_shapes
from .tuning import X86Tuning

#: Seconds of runs per timing block of one candidate (at least one run).
BLOCK_SECONDS = 0.02
#: Blocks per candidate; the best one counts.
ROUNDS = 7
#: The default of ``tune_budget``: seconds of measuring per compile.
DEFAULT_BUDGET = 600.0
_clock = time.monotonic       # the budget's clock (a test steps it)
#: A register tile whose padded work (:func:`cuvil.kernels.contraction.tile_cost`) is more than this many
#: times the least is not measured: on ResNet-50 and SqueezeNet that drops the channel-lane 48 x 7 on 56 x 56
#: maps (1.6x) and 8 x 48 on 7 x 7 ones (1.8x), a candidate build each (2-4 s) that padding alone makes slower
PRUNE = 1.3


@attrs.frozen
class ConvLayer:
    """One float32 convolution layer as the tuner measures it: input ``[n, c, h, w]``, weights
    ``[k, c / group, kh, kw]``, the node's attributes (``attrs``, sorted pairs) and output ``[oh, ow]``."""
    x_shape: Tuple[int, ...]
    w_shape: Tuple[int, ...]
    bias: bool
    attrs: Tuple[Tuple[str, object], ...]
    out_spatial: Tuple[int, int]

    @property
    def group(self) -> int:
        return int(dict(self.attrs).get("group", 1) or 1)

    @property
    def gemm_key(self) -> Tuple[int, int, int]:
        """(output channels per group, positions, reduction terms): ``X86Tuning.layer_tiles``' key."""
        k, cin_g, kh, kw = self.w_shape
        return (k // self.group, self.out_spatial[0] * self.out_spatial[1], cin_g * kh * kw)

    @property
    def winograd_key(self) -> Optional[Tuple[int, int, int, int]]:
        """(c, k, oh, ow), ``X86Tuning.layer_winograd``'s key, where a Winograd rule may take the layer."""
        a = dict(self.attrs)
        k, c, kh, kw = self.w_shape
        if ((kh, kw) != (3, 3) or self.group != 1 or any(s != 1 for s in a.get("strides") or (1, 1))
                or any(d != 1 for d in a.get("dilations") or (1, 1)) or min(c, k) < MIN_CHANNELS):
            return None
        return (c, k) + tuple(self.out_spatial)

    @property
    def flops(self) -> int:
        m, p, kk = self.gemm_key
        return 2 * self.x_shape[0] * self.group * m * p * kk

    def describe(self) -> str:
        k, cin_g, kh, kw = self.w_shape
        a = dict(self.attrs)
        s = "x".join(str(v) for v in (a.get("strides") or (1, 1)))
        g = f" group {self.group}" if self.group > 1 else ""
        return (f"conv {kh}x{kw}/{s} {self.x_shape[1]}->{k}{g} "
                f"{self.x_shape[2]}x{self.x_shape[3]}->{self.out_spatial[0]}x{self.out_spatial[1]}")

    def signature(self) -> dict:
        return {"x": list(self.x_shape), "w": list(self.w_shape), "bias": self.bias,
                "attrs": [[n, _jsonable(v)] for n, v in self.attrs]}

    def graph(self) -> Graph:
        """The layer alone: Conv (+ bias) -> Relu, weights seeded by the shape."""
        rng = np.random.default_rng(list(self.x_shape) + list(self.w_shape))
        g = Graph(name="tune_layer")
        x = g.add_input("x", TensorType(DType.FLOAT, self.x_shape))
        fan_in = int(np.prod(self.w_shape[1:]))
        w = g.const((rng.standard_normal(self.w_shape) / np.sqrt(fan_in)).astype(np.float32), "w")
        ins = [x, w]
        if self.bias:
            ins.append(g.const((rng.standard_normal(self.w_shape[0]) * 0.1).astype(np.float32), "b"))
        conv = g.add_node("Conv", ins, dict(self.attrs), name="conv")
        relu = g.add_node("Relu", [conv.outputs[0]], name="relu")
        g.add_output(relu.outputs[0], "y")
        return g


def _jsonable(v):
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return repr(v)


def _static(dims) -> bool:
    return dims is not None and all(isinstance(d, int) for d in dims)


def conv_layers(graph: Graph) -> List[ConvLayer]:
    """The distinct convolution layers of ``graph`` the tuner can measure (float32, 2-D, constant weights,
    static shapes, enough output channels per group for the micro-kernels), largest first."""
    seen: Dict[ConvLayer, None] = {}
    opt = {name: sym.tuned for name, sym in graph.symbols.items()}
    for node in graph.nodes:
        layer = _layer_of(node, opt)
        if layer is not None:
            seen.setdefault(layer, None)
    return sorted(seen, key=lambda lay: -lay.flops)


def _layer_of(node: Node, opt: Dict[str, int]) -> Optional[ConvLayer]:
    """``node`` as a ConvLayer, a symbolic batch at its opt value (the register tile and the Winograd choice
    are per image: their keys hold no batch), or None when the tuner cannot measure it."""
    if node.op != "Conv" or node.domain or node.precision:
        return None
    x, w, b = node.input(0), node.input(1), node.input(2)
    y = node.outputs[0]
    if (x is None or w is None or not w.is_const or x.dtype != DType.FLOAT or w.dtype != DType.FLOAT
            or x.shape is None or len(x.shape) != 4 or not _static(x.shape[1:]) or not _static(w.shape)
            or y.shape is None or not _static(y.shape[1:]) or (b is not None and not b.is_const)):
        return None
    batch = x.shape[0]
    if not isinstance(batch, int):
        try:
            batch = int(batch.evaluate(opt))
        except (AttributeError, KeyError, TypeError, ValueError):
            return None
    layer = ConvLayer((batch,) + tuple(x.shape[1:]), tuple(w.shape), b is not None,
                      tuple(sorted((k, _hashable(v)) for k, v in node.attrs.items())), tuple(y.shape[2:]))
    m, _, kk = layer.gemm_key
    return layer if m >= 4 and kk >= 4 else None


def _hashable(v):
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, np.ndarray):
        return tuple(v.tolist())
    if isinstance(v, np.integer):
        return int(v)
    return v


def tile_label(tile) -> str:
    rows, cols = tile[:2]
    return f"direct {rows}x{cols}" + (" channel-lane" if channel_lanes(tile) else "")


def candidates(layer: ConvLayer, bits: int, base: X86Tuning) -> Dict[str, X86Tuning]:
    """The schedules measured for ``layer`` on a CPU with ``bits``-wide vectors, by label: ``base`` with the
    layer's Winograd choice and register tile forced (``layer_winograd``, ``layer_tiles``)."""
    shapes = tile_shapes(bits, base)
    m, p, kk = layer.gemm_key
    wkey = layer.winograd_key
    direct = ((wkey, 0),) if wkey else ()
    costs = {tile: tile_cost(m, p, tile, kk, base.channel_tile_cost) for tile in shapes}
    least = min(costs.values())
    own = tuple(choose_tile(m, p, shapes, kk, base.channel_tile_cost))
    out = {}
    for tile in shapes:
        if costs[tile] > PRUNE * least and tuple(tile) != own:   # channel-lane below CHANNEL_FLOOR_K: inf
            continue
        out[tile_label(tile)] = attrs.evolve(base, layer_winograd=direct, layer_tiles=(((m, p, kk), tile),))
    if wkey:
        for t in (2, 4):
            out[f"winograd F({t}x{t})"] = attrs.evolve(base, layer_winograd=((wkey, t),), layer_tiles=())
    return out


def default_label(layer: ConvLayer, bits: int, base: X86Tuning) -> str:
    """The label of the cost model's own choice for ``layer`` (what an untuned build takes)."""
    shapes = tile_shapes(bits, base)
    wkey = layer.winograd_key
    if wkey:
        t = best_tile(wkey[0], wkey[1], wkey[2], wkey[3], shapes, base)
        if t:
            return f"winograd F({t}x{t})"
    m, p, kk = layer.gemm_key
    return tile_label(choose_tile(m, p, shapes, kk, base.channel_tile_cost))


# ------------------------------------------------------------------------------------------ the cache

def tune_cache_dir() -> str:
    base = os.environ.get("CUVIL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuvil")
    return os.path.join(base, "tune")


@functools.lru_cache(maxsize=1)
def _codegen_digest() -> str:
    """A digest of the sources that generate the measured kernels (this backend and the kernel layer): a
    choice measured on other kernels is not reused."""
    here = os.path.dirname(os.path.abspath(__file__))
    roots = [here, os.path.join(here, "..", "..", "kernels")]
    h = hashlib.sha256()
    for root in roots:
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".c", ".h")) and name != "tune.py":   # the tuner emits no code
                    with open(os.path.join(folder, name), "rb") as f:
                        h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()[:16]


def cpu_key(cpu=None) -> dict:
    """The host CPU as the cache key names it: cpuid's vendor, brand string, family / model / stepping and
    the ISA features."""
    c = cpu or host_cpu()
    return {"vendor": c.vendor, "model_name": c.model_name, "family": c.family, "model": c.model,
            "stepping": c.stepping, "features": sorted(c.features)}


def cache_key(layer: ConvLayer, threads: int, opt_level: int, base: X86Tuning, cpu=None) -> str:
    """The cache file name of ``layer``'s choice (see the module docstring for what it covers)."""
    parts = {"cpu": cpu_key(cpu), "layer": layer.signature(), "dtype": "float32", "threads": threads,
             "opt_level": opt_level, "version": __version__, "codegen": _codegen_digest(),
             "base": repr(attrs.evolve(base, layer_winograd=(), layer_tiles=()))}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _read_cached(folder: str, key: str) -> Optional[dict]:
    try:
        with open(os.path.join(folder, key + ".json"), encoding="utf-8") as f:
            entry = json.load(f)
    except (OSError, ValueError):
        return None
    if (not isinstance(entry, dict) or not isinstance(entry.get("choice"), str)
            or not isinstance(entry.get("seconds"), dict)):
        return None         # not ours, or damaged: measured again
    if entry["choice"].startswith("winograd"):
        return entry if entry["choice"] in ("winograd F(2x2)", "winograd F(4x4)") else None
    tile = entry.get("tile")
    return entry if isinstance(tile, list) and len(tile) == 3 else None


def _write_cached(folder: str, key: str, entry: dict) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(folder, key + ".json"))
        return True
    except OSError as e:
        warnings.warn(f"--tune: cannot write the tuning cache {folder} ({e.strerror or e}); this build uses the "
                      "choices measured now and the next one measures them again. Set CUVIL_CACHE_DIR to a "
                      "writable directory to keep them", RuntimeWarning, stacklevel=2)
        return False


# ------------------------------------------------------------------------------------------ measuring

def _build(layer: ConvLayer, tuning: X86Tuning, path: str, cpu: Optional[str], opt_level: int, math: str,
           choose: Callable) -> dict:
    """The target's own build steps for the layer alone: its algorithm choice (``choose(graph, cpu, tuning)``,
    the target's Winograd rules) and :func:`cuvil.targets.x86.compile.compile_x86`."""
    with progress_enabled(False):        # the tune stage reports per layer, not each candidate's build
        g = choose(layer.graph(), cpu, tuning)
        manifest = compile_x86(g, path, opt_level=opt_level, cpu=cpu, tuning=tuning, math=math)
    manifest["winograd"] = [n.attrs.get("tile") for n in g.nodes if n.op == "WinogradConv"]
    return manifest


def time_libraries(paths: List[str], x_shape, threads: int, rounds: int = ROUNDS,
                   timeout: float = 120.0) -> Optional[List[float]]:
    """Seconds per run of each library (one input ``x`` of ``x_shape``), measured side by side in a child
    process; None when the child fails (a crash, a timeout)."""
    spec = json.dumps({"paths": paths, "x_shape": list(x_shape), "threads": threads, "rounds": rounds})
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        r = subprocess.run([sys.executable, "-m", "cuvil.targets.x86.tune", spec], capture_output=True,
                           text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    try:
        times = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return times if isinstance(times, list) and len(times) == len(paths) else None


def _child(spec: dict) -> List[float]:
    from .loader import load
    x = np.random.default_rng(0).standard_normal(spec["x_shape"]).astype(np.float32)
    models = [load(p, num_threads=spec["threads"]) for p in spec["paths"]]
    reps = []
    for m in models:                     # warm up, and runs per block of about BLOCK_SECONDS
        m.run(x)
        t0 = time.perf_counter()
        m.run(x)
        reps.append(max(1, int(BLOCK_SECONDS / max(time.perf_counter() - t0, 1e-6))))
    # one thread runs on this one: its CPU time leaves out the time a shared machine deschedules it
    clock = time.thread_time if spec["threads"] == 1 else time.perf_counter
    best = [float("inf")] * len(models)
    for r in range(spec["rounds"]):
        order = range(len(models)) if r % 2 == 0 else reversed(range(len(models)))
        for i in order:
            t0 = clock()
            for _ in range(reps[i]):
                models[i].run(x)
            best[i] = min(best[i], (clock() - t0) / reps[i])
    return best


@attrs.frozen
class TuneResult:
    """What :func:`tune_graph` chose: the tuning to build with and the manifest's ``tune`` entry."""
    tuning: X86Tuning
    report: dict


def tune_graph(graph: Graph, base: X86Tuning, *, cpu: Optional[str] = None, opt_level: int = 3,
               threads: int = 1, budget: Optional[float] = None, math: str = "vector",
               cache_dir: Optional[str] = None, progress=None, choose: Optional[Callable] = None) -> TuneResult:
    """Measure the candidate schedules of ``graph``'s convolution layers on this CPU (``threads`` threads),
    within ``budget`` seconds (default :data:`DEFAULT_BUDGET`), reusing and filling the cache
    (``cache_dir``, default :func:`tune_cache_dir`); ``base`` with the measured choices as its
    ``layer_winograd`` / ``layer_tiles``, and the report. ``choose(graph, cpu, tuning)``: the target's
    algorithm choice a candidate is built with (the x86 target passes its Winograd rewrite)."""
    if not is_host_name(cpu):
        raise CuvilError(f"--tune measures the candidate kernels on this machine, so it cannot build for "
                         f"--cpu {cpu}", hint="drop --cpu to tune for this CPU, or drop --tune to build for "
                         f"{cpu} with the cost model's choices")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise CuvilError(f"tune_threads={threads!r}: the thread count to time with must be a positive int")
    budget = DEFAULT_BUDGET if budget is None else float(budget)
    folder = cache_dir or tune_cache_dir()
    host = host_cpu()
    bits = describe_cpu(cpu).vector_bits
    start = _clock()
    winograd, tiles, rows = {}, {}, []
    for layer in conv_layers(graph):
        key = cache_key(layer, threads, opt_level, base, host)
        entry = _read_cached(folder, key)
        source = "cache"
        if entry is None:
            remaining = budget - (_clock() - start)
            entry = (_measure(layer, bits, base, cpu, opt_level, threads, math, start, budget, choose)
                     if remaining > 0 else None)
            if entry is None:
                rows.append({"layer": layer.describe(), "choice": default_label(layer, bits, base),
                             "source": "cost model (budget spent)" if remaining <= 0 or
                             _clock() - start >= budget else "cost model (measurement failed)"})
                continue
            source = "measured"
            _write_cached(folder, key, entry)
        if progress is not None:
            progress(f"{layer.describe()}: {entry['choice']} ({source})")
        choice = entry["choice"]
        if layer.winograd_key:
            winograd[layer.winograd_key] = int(choice[len("winograd F("):][0]) if choice.startswith("winograd") else 0
        if not choice.startswith("winograd"):
            tiles[layer.gemm_key] = tuple(entry["tile"])
        rows.append({"layer": layer.describe(), "choice": choice, "default": entry["default"],
                     "ms": {k: round(v * 1e3, 4) for k, v in entry["seconds"].items()}})
    tuned = attrs.evolve(base, layer_winograd=tuple(winograd.items()), layer_tiles=tuple(tiles.items()))
    report = {"cpu": host.label(), "threads": threads, "budget_seconds": budget, "layers": rows}
    return TuneResult(tuned, report)


def _measure(layer: ConvLayer, bits: int, base: X86Tuning, cpu, opt_level: int, threads: int, math: str,
             start: float, budget: float, choose: Optional[Callable]) -> Optional[dict]:
    """Build and time every candidate of ``layer``; the cache entry of the fastest, or None (out of budget
    before every candidate was built, or the timing child failed)."""
    cands = candidates(layer, bits, base)
    tmp = tempfile.mkdtemp(prefix="cuvil-tune-")
    try:
        built = {}
        for label, tuning in cands.items():
            if _clock() - start >= budget:
                return None
            path = os.path.join(tmp, f"lib{len(built)}.so")
            if choose is None:
                raise ValueError("tune_graph(choose=...): the target's algorithm choice builds the candidates")
            manifest = _build(layer, tuning, path, cpu, opt_level, math, choose)
            if label.startswith("winograd") and not manifest["winograd"]:
                continue               # no Winograd rule takes this layer (its pads): the direct build again
            built[label] = path
        times = time_libraries(list(built.values()), layer.x_shape, threads)
        if times is None:
            return None
        seconds = dict(zip(built, times))
        choice = min(seconds, key=seconds.get)
        entry = {"choice": choice, "seconds": seconds, "default": default_label(layer, bits, base),
                 "layer": layer.describe(), "signature": layer.signature(), "threads": threads}
        if not choice.startswith("winograd"):
            entry["tile"] = list(dict(cands[choice].layer_tiles)[layer.gemm_key])
        return entry
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":      # the timing child of time_libraries
    print(json.dumps(_child(json.loads(sys.argv[1]))))
