"""Running an x86 artifact ``lib<name>.so`` from Python through its C ABI (ctypes; no recompilation).

    m = load("libnet.so")            # prefix from libnet.manifest.json ("prefix"), else "cuvil"
    (y,) = m.run(x)                  # or m.run(data=x); numpy in, numpy out
    m.close()                        # or `with load(...) as m:`

Nothing is converted silently: arrays go to the library as they are (made contiguous and aligned if
needed, never cast), and the library's own validation decides; its error becomes a ShapeError that carries
``<prefix>_strerror`` and ``<prefix>_last_error``.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading

import attrs
import numpy as np

from cuvil.errors import CuvilError, ShapeError
from cuvil.ir.dtype import DType
from cuvil.targets.x86.model_info import is_c_identifier


class CTensor(ctypes.Structure):
    """``cuvil_tensor``."""
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64))]


@attrs.frozen
class IOSpec:
    """An input or output as the library declares it. ``dtype`` is the numpy dtype (None if numpy has none,
    e.g. bfloat16), ``code`` the ONNX TensorProto code, ``shape`` ints with None for symbolic dims."""

    name: str
    dtype: np.dtype | None
    shape: tuple
    code: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _numpy_dtype(code: int) -> np.dtype | None:
    try:
        return DType(code).numpy
    except (ValueError, TypeError):
        return None


_CODES = {}
for _code in range(1, 17):
    _dt = _numpy_dtype(_code)
    if _dt is not None and _dt.kind != "O":
        _CODES.setdefault(_dt, _code)


def _dtype_code(dt: np.dtype) -> int:
    """ONNX code of a numpy dtype; 0 (undefined) when it has none (e.g. non-native byte order), so that the
    library rejects it with its own message."""
    return _CODES.get(dt, 0)


def manifest_path(so_path: str) -> str:
    """``libnet.manifest.json`` for ``libnet.so``."""
    base = so_path[:-3] if so_path.endswith(".so") else so_path
    return base + ".manifest.json"


def _read_prefix(so_path: str) -> str:
    mp = manifest_path(so_path)
    if os.path.isfile(mp):
        try:
            with open(mp, encoding="utf-8") as f:
                prefix = json.load(f).get("prefix", "cuvil")
        except (OSError, ValueError, AttributeError) as e:
            raise CuvilError(f"{mp}: unreadable manifest: {e}") from e
        return prefix
    return "cuvil"


class Model:
    """A loaded artifact. One lazily created session (``num_threads``, 0 = all cores) serves ``run``; calls to
    ``run`` from several Python threads are serialised by a lock."""

    def __init__(self, path: str, prefix: str | None = None, num_threads: int = 0):
        self.path = os.path.abspath(path)
        if not os.path.isfile(self.path):
            raise CuvilError(f"{path!r} does not exist")
        self.prefix = _read_prefix(self.path) if prefix is None else prefix
        if not is_c_identifier(self.prefix):
            raise CuvilError(f"{path}: prefix {self.prefix!r} is not a C identifier")
        try:
            self._lib = ctypes.CDLL(self.path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except OSError as e:
            raise CuvilError(f"cannot load {path}: {e}") from e
        self._bind()
        self.num_threads = num_threads
        self._session = None
        self._session_threads = None
        self._lock = threading.Lock()
        self.inputs = [self._spec(True, i) for i in range(self._f.num_inputs())]
        self.outputs = [self._spec(False, j) for j in range(self._f.num_outputs())]
        self._in_tensors = (CTensor * max(1, len(self.inputs)))()
        self._out_tensors = (CTensor * max(1, len(self.outputs)))()
        # Shape arrays handed to the library, reused across runs (filled under the lock).
        self._in_shapes = [(ctypes.c_int64 * max(1, d.ndim))() for d in self.inputs]
        self._out_shapes = [(ctypes.c_int64 * max(1, d.ndim))() for d in self.outputs]
        for t, d, shape in zip(self._out_tensors, self.outputs, self._out_shapes):
            t.dtype, t.ndim, t.shape = d.code, d.ndim, shape
            shape[:d.ndim] = [-1 if v is None else v for v in d.shape]
        self._static_outputs = all(v is not None for d in self.outputs for v in d.shape)
        self._index = {d.name: k for k, d in enumerate(self.inputs)}

    # -- ctypes binding ------------------------------------------------------------------------------

    def _bind(self) -> None:
        p, lib = self.prefix, self._lib
        i32p, i64p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
        tp = ctypes.POINTER(CTensor)
        sigs = {
            "num_inputs": (ctypes.c_int, []), "num_outputs": (ctypes.c_int, []),
            "input_name": (ctypes.c_char_p, [ctypes.c_int]), "output_name": (ctypes.c_char_p, [ctypes.c_int]),
            "input_info": (ctypes.c_int, [ctypes.c_int, i32p, i32p, i64p]),
            "output_info": (ctypes.c_int, [ctypes.c_int, i32p, i32p, i64p]),
            "session_create": (ctypes.c_void_p, [ctypes.c_int]),
            "output_shape": (ctypes.c_int, [ctypes.c_void_p, tp, ctypes.c_int, i64p]),
            "run": (ctypes.c_int, [ctypes.c_void_p, tp, tp]),
            "strerror": (ctypes.c_char_p, [ctypes.c_int]),
            "last_error": (ctypes.c_char_p, []),
            "session_destroy": (None, [ctypes.c_void_p]),
            "profile": (ctypes.c_int, [ctypes.c_void_p, i64p, ctypes.c_int32]),
        }

        class _F:
            pass

        f = _F()
        for name, (res, args) in sigs.items():
            try:
                fn = getattr(lib, f"{p}_{name}")
            except AttributeError:
                raise CuvilError(f"{self.path}: no symbol {p}_{name}; not a Cuvil artifact with prefix {p!r} "
                                 f"(pass prefix=... or keep lib<name>.manifest.json next to the library)") from None
            fn.restype, fn.argtypes = res, args
            setattr(f, name, fn)
        self._f = f

    @property
    def lib(self) -> ctypes.CDLL:
        """The raw ctypes library (functions ``<prefix>_*``)."""
        return self._lib

    def _spec(self, is_input: bool, i: int) -> IOSpec:
        f = self._f
        info, name_fn = (f.input_info, f.input_name) if is_input else (f.output_info, f.output_name)
        dtype, ndim = ctypes.c_int32(), ctypes.c_int32()
        self._check(info(i, ctypes.byref(dtype), ctypes.byref(ndim), None), CuvilError)
        shape = (ctypes.c_int64 * max(1, ndim.value))()
        self._check(info(i, None, None, shape), CuvilError)
        name = name_fn(i).decode("utf-8", errors="surrogateescape")
        dims = tuple(None if shape[k] < 0 else int(shape[k]) for k in range(ndim.value))
        return IOSpec(name=name, dtype=_numpy_dtype(dtype.value), shape=dims, code=dtype.value)

    def error_message(self, code: int) -> str:
        msg = self._f.strerror(code).decode()
        detail = (self._f.last_error() or b"").decode("utf-8", errors="replace")
        return f"{msg}: {detail}" if detail else msg

    def _check(self, code: int, exc=ShapeError) -> None:
        if code != 0:
            raise exc(f"{os.path.basename(self.path)}: {self.error_message(code)} (code {code})")

    # -- sessions -----------------------------------------------------------------------------------

    def _get_session(self, num_threads: int | None):
        n = self.num_threads if num_threads is None else num_threads
        if self._session is not None and n == self._session_threads:
            return self._session
        if self._session is not None:
            self._f.session_destroy(self._session)
            self._session = None
        s = self._f.session_create(int(n))
        if not s:
            raise CuvilError(f"{os.path.basename(self.path)}: cannot create a session with num_threads={n}: "
                             f"{(self._f.last_error() or b'').decode()}")
        self._session, self._session_threads = s, n
        return s

    def close(self) -> None:
        """Destroys the session (the library stays loaded; ``run`` creates a new session if called again)."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:
            if getattr(self, "_session", None):
                self._f.session_destroy(self._session)
                self._session = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- running ------------------------------------------------------------------------------------

    def _collect(self, arrays, named) -> list:
        n = len(self.inputs)
        if len(arrays) > n:
            raise ShapeError(f"{os.path.basename(self.path)}: {len(arrays)} positional inputs, the model has {n}")
        given = list(arrays) + [None] * (n - len(arrays))
        have = [True] * len(arrays) + [False] * (n - len(arrays))
        for name, value in named.items():
            k = self._index.get(name)
            if k is None:
                raise ShapeError(f"{os.path.basename(self.path)}: unknown input {name!r} "
                                 f"(inputs: {', '.join(d.name for d in self.inputs)})")
            if have[k]:
                raise ShapeError(f"{os.path.basename(self.path)}: input {name!r} given twice")
            given[k], have[k] = value, True
        missing = [self.inputs[k].name for k in range(n) if not have[k]]
        if missing:
            raise ShapeError(f"{os.path.basename(self.path)}: missing input(s) {', '.join(map(repr, missing))}")
        out = []
        for x in given:
            a = np.asarray(x)  # no dtype: nothing is cast
            if not (a.flags.c_contiguous and a.flags.aligned):
                a = np.require(a, requirements=("C_CONTIGUOUS", "ALIGNED"))
            out.append(a)
        return out

    def run(self, *arrays, num_threads: int | None = None, **named) -> list[np.ndarray]:
        """Runs the model on numpy arrays given in input order and/or by name; returns the outputs in order."""
        xs = self._collect(arrays, named)
        for d in self.outputs:
            if d.dtype is None:
                raise CuvilError(f"{os.path.basename(self.path)}: output {d.name!r} has dtype code {d.code}, "
                                 f"which numpy cannot hold")
        with self._lock:
            s = self._get_session(num_threads)
            ins, keep = self._in_tensors, []
            for k, a in enumerate(xs):
                shape = self._in_shapes[k]
                if a.ndim > len(shape):  # wrong rank: the library reports it
                    shape = (ctypes.c_int64 * a.ndim)()
                    keep.append(shape)
                shape[:a.ndim] = a.shape
                t = ins[k]
                t.data = a.ctypes.data or None
                t.dtype = _dtype_code(a.dtype)
                t.ndim = a.ndim
                t.shape = shape
            outs = []
            for j, d in enumerate(self.outputs):
                shape = self._out_shapes[j]
                if self._static_outputs:
                    dims = d.shape
                else:
                    self._check(self._f.output_shape(s, ins, j, shape))
                    dims = tuple(shape[k] for k in range(d.ndim))
                y = np.empty(dims, dtype=d.dtype)
                outs.append(y)
                self._out_tensors[j].data = y.ctypes.data or None
            self._check(self._f.run(s, ins, self._out_tensors))
            del keep
        return outs

    def profile(self, *arrays, runs: int = 10, num_threads: int | None = None, **named) -> list[float]:
        """Seconds per run spent in each step (kernel) of the model, averaged over ``runs`` runs after one
        warm-up; the manifest's ``steps`` names them."""
        self.run(*arrays, num_threads=num_threads, **named)
        with self._lock:
            s = self._get_session(num_threads)
            n = self._check_count(self._f.profile(s, None, 0))
            acc = (ctypes.c_int64 * max(1, n))()
            self._check_count(self._f.profile(s, acc, n))
        try:
            for _ in range(runs):
                self.run(*arrays, num_threads=num_threads, **named)
        finally:
            with self._lock:
                self._f.profile(s, None, 0)
        return [acc[k] / 1e9 / runs for k in range(n)]

    def _check_count(self, rc: int) -> int:
        if rc < 0:
            self._check(rc, CuvilError)
        return rc

    def __repr__(self) -> str:
        fmt = lambda ds: ", ".join(f"{d.name}: {d.dtype}{list(d.shape)}" for d in ds)  # noqa: E731
        return f"<cuvil.Model {os.path.basename(self.path)} ({fmt(self.inputs)}) -> ({fmt(self.outputs)})>"


def load(path: str, prefix: str | None = None, num_threads: int = 0) -> Model:
    """Loads ``lib<name>.so``. ``prefix`` defaults to the manifest's ``"prefix"``, else ``"cuvil"``;
    ``num_threads`` (0 = all cores) is the default for the session ``run`` creates."""
    return Model(path, prefix=prefix, num_threads=num_threads)
