"""Running an x86 artifact ``lib<name>.so`` from Python through its C ABI (ctypes; no recompilation).

    m = load("libnet.so")            # prefix from libnet.manifest.json ("prefix"), else "cuvil"
    (y,) = m.run(x)                  # or m.run(data=x); numpy in, numpy out
    m.close()                        # or `with load(...) as m:`

Nothing is converted silently: arrays go to the library as they are (made contiguous and aligned if
needed, never cast). Each input's dtype, rank, static dims and profile range are checked here first, with a
ShapeError that names the input and says what to pass instead; the library validates again and its error
becomes a ShapeError that carries ``<prefix>_strerror`` and ``<prefix>_last_error``. Output buffers are
allocated only after their shapes were checked and their size against ``Model.max_output_bytes``. A closed
model raises CuvilError.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading

import attrs
import numpy as np

from cuvil.errors import CuvilError, ShapeError, UnsupportedTypeError
from cuvil.ir.dim import is_symbol_name
from cuvil.ir.dtype import DType
from cuvil.targets.x86.cpu import check_runs_here
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
    except (ValueError, UnsupportedTypeError):
        return None


_CODES = {}
for _code in range(1, 27):
    _dt = _numpy_dtype(_code)
    if _dt is not None and _dt.kind != "O":
        _CODES.setdefault(_dt, _code)


def _dtype_code(dt: np.dtype) -> int:
    """ONNX code of a numpy dtype; 0 (undefined) when it has none (e.g. non-native byte order), so that the
    library rejects it with its own message."""
    return _CODES.get(dt, 0)


#: The ONNX names of the dtype codes, as the runtime prints them (runtime.c dtype_name).
_CODE_NAMES = ("undefined", "float", "uint8", "int8", "uint16", "int16", "int32", "int64", "string", "bool",
               "float16", "double", "uint32", "uint64", "complex64", "complex128", "bfloat16", "float8e4m3fn",
               "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz", "uint4", "int4", "float4e2m1", "float8e8m0", "uint2",
               "int2")

#: Runtime codes that mean the session handle itself is unusable (not the inputs): CUVIL_ERR_NULL_SESSION,
#: CUVIL_ERR_BUSY, CUVIL_ERR_BAD_SESSION.
_SESSION_CODES = (-1, -13, -20)


def _code_name(code: int) -> str:
    return _CODE_NAMES[code] if 0 <= code < len(_CODE_NAMES) else "unknown"


def default_max_output_bytes() -> int:
    """The largest total of output bytes one ``run`` allocates by default: the machine's physical memory
    (larger outputs could only fail in numpy, or swap)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def manifest_path(so_path: str) -> str:
    """``libnet.manifest.json`` for ``libnet.so``."""
    base = so_path[:-3] if so_path.endswith(".so") else so_path
    return base + ".manifest.json"


def _read_manifest(so_path: str) -> dict:
    mp = manifest_path(so_path)
    if not os.path.isfile(mp):
        return {}
    try:
        with open(mp, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CuvilError(f"{mp}: unreadable manifest: {e}") from e
    if not isinstance(manifest, dict):
        raise CuvilError(f"{mp}: unreadable manifest: not a JSON object")
    return manifest


def _check_isa(manifest: dict, path: str) -> None:
    """Refuse, before the library is mapped, one built with ISA features this CPU lacks (the manifest's
    ``target.isa_features``; older manifests have none and are not checked)."""
    target = manifest.get("target")
    required = target.get("isa_features") if isinstance(target, dict) else None
    if isinstance(required, list):
        check_runs_here([str(f) for f in required], os.path.basename(path), str(target.get("cpu", "")))


def _input_symbols(manifest: dict, k: int, ndim: int) -> tuple:
    """Per dim of input k, the symbol name the manifest gives it (a plain symbol), else None."""
    try:
        shape = manifest["inputs"][k]["shape"]
    except (KeyError, IndexError, TypeError):
        return (None,) * ndim
    if not isinstance(shape, list) or len(shape) != ndim:
        return (None,) * ndim
    return tuple(v if is_symbol_name(v) else None for v in shape)


class Model:
    """A loaded artifact. One lazily created session (``num_threads``, 0 = all cores) serves ``run``; calls to
    ``run`` from several Python threads are serialised by a lock. After ``close()`` (or the end of a ``with``
    block) the model raises CuvilError; load the library again to run it. ``max_output_bytes`` bounds what one
    ``run`` allocates for its outputs (default: the machine's physical memory)."""

    def __init__(self, path: str, prefix: str | None = None, num_threads: int = 0,
                 max_output_bytes: int | None = None):
        self._closed = True                       # until the library is bound (close() and __del__ rely on it)
        self.path = os.path.abspath(path)
        if not os.path.isfile(self.path):
            raise CuvilError(f"{path!r} does not exist")
        manifest = _read_manifest(self.path)
        _check_isa(manifest, path)
        if prefix is None:
            prefix = manifest.get("prefix", "cuvil")
        self.prefix = prefix
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
        self.max_output_bytes = default_max_output_bytes() if max_output_bytes is None else int(max_output_bytes)
        self.symbols = self._symbols()
        # a symbol's multiple (the C ABI reports min/opt/max; the library checks the multiple itself)
        self._multiples = {name: int(s.get("multiple", 1)) for name, s in (manifest.get("symbols") or {}).items()
                           if isinstance(s, dict)}
        self._dim_symbols = [_input_symbols(manifest, k, d.ndim) for k, d in enumerate(self.inputs)]
        if self._static_outputs:
            self._check_output_sizes([d.shape for d in self.outputs])
        self._closed = False

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
            "num_symbols": (ctypes.c_int, []),
            "symbol_info": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), i64p, i64p, i64p]),
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

    def _symbols(self) -> dict:
        """``{name: (min, opt, max)}``: the shape symbols and their profile, as the library reports them."""
        out = {}
        for i in range(self._f.num_symbols()):
            name, lo, opt, hi = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
            self._check(self._f.symbol_info(i, ctypes.byref(name), ctypes.byref(lo), ctypes.byref(opt),
                                            ctypes.byref(hi)), CuvilError)
            out[(name.value or b"").decode("utf-8", errors="surrogateescape")] = (lo.value, opt.value, hi.value)
        return out

    def error_message(self, code: int) -> str:
        msg = self._f.strerror(code).decode()
        detail = (self._f.last_error() or b"").decode("utf-8", errors="replace")
        return f"{msg}: {detail}" if detail else msg

    def _check(self, code: int, exc=ShapeError) -> None:
        if code != 0:
            if code in _SESSION_CODES:
                exc = CuvilError
            raise exc(f"{os.path.basename(self.path)}: {self.error_message(code)} (code {code})")

    def _check_input(self, k: int, a: np.ndarray) -> None:
        """What the library checks, checked first here with the library's code and wording and what to pass
        instead."""
        d = self.inputs[k]
        where = f"input {k} '{d.name}'"

        def refuse(code: int, detail: str, fix: str):
            msg = self._f.strerror(code).decode()
            raise ShapeError(f"{os.path.basename(self.path)}: {msg}: {where}: {detail}; {fix} (code {code})")
        if d.dtype is None or a.dtype != d.dtype:
            code = _dtype_code(a.dtype)
            fix = (f"convert it with .astype(numpy.{d.dtype.name})" if d.dtype is not None
                   else f"numpy has no dtype for code {d.code}; call the C ABI directly")
            refuse(-6, f"dtype is {code} ({_code_name(code) if code else a.dtype}), expected {d.code} "
                       f"({_code_name(d.code)})", fix)
        if a.ndim != d.ndim:
            refuse(-7, f"ndim is {a.ndim}, expected {d.ndim}", f"reshape it to {_shape_text(d.shape)}")
        for i, (got, want) in enumerate(zip(a.shape, d.shape)):
            if want is not None and got != want:
                refuse(-8, f"dim {i} is {got}, expected {want}", f"pass an array of shape {_shape_text(d.shape)}")
            sym = self._dim_symbols[k][i]
            if want is None and sym in self.symbols:
                lo, _, hi = self.symbols[sym]
                if not lo <= got <= hi:
                    refuse(-19, f"dim {i} is {sym} = {got}, outside the profile {sym} in [{lo}, {hi}]",
                           f"split the input, or compile with --shape-profile {sym}=MIN:OPT:MAX covering {got} "
                           f"(or --input-shape {d.name}=MIN:OPT:MAX, three shapes)")
                multiple = self._multiples.get(sym, 1)
                if multiple > 1 and got % multiple:
                    refuse(-19, f"dim {i} is {sym} = {got}, not a multiple of {multiple} (the profile {sym} in "
                               f"[{lo}, {hi}], multiples of {multiple})",
                           f"pad the input to a multiple of {multiple} (e.g. {-(-got // multiple) * multiple})")

    def _check_output_sizes(self, shapes) -> None:
        """Every output dim >= 0 and their bytes within ``max_output_bytes``, before anything is allocated."""
        lib, total = os.path.basename(self.path), 0
        for d, dims in zip(self.outputs, shapes):
            if any(v is None or v < 0 for v in dims):
                raise CuvilError(f"{lib}: output '{d.name}' has shape {_shape_text(dims)}, which no array can have; "
                                 f"the library is damaged or mismatched: compile the model again")
            n = d.dtype.itemsize if d.dtype is not None else 1
            for v in dims:
                n *= int(v)
            total += n
            if total > self.max_output_bytes:
                raise CuvilError(f"{lib}: output '{d.name}' of shape {_shape_text(dims)} takes {n} bytes, over the "
                                 f"{self.max_output_bytes} that one run may allocate for its outputs; run smaller "
                                 f"inputs, or load with max_output_bytes=... if the machine has the memory")

    # -- sessions -----------------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise CuvilError(f"{os.path.basename(self.path)}: the model was closed (close() or the end of its with "
                             f"block); load it again with cuvil.load({self.path!r}) to run it")

    def _get_session(self, num_threads: int | None):
        self._ensure_open()
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
        """Destroys the session; the model then raises CuvilError if used again (closing twice is harmless)."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:
            self._closed = True
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
        for k, x in enumerate(given):
            try:
                a = np.asarray(x)  # no dtype: nothing is cast
            except (ValueError, TypeError) as e:
                raise ShapeError(f"{os.path.basename(self.path)}: input {k} '{self.inputs[k].name}' is not an array "
                                 f"({e}); pass a numpy array") from None
            self._check_input(k, a)
            out.append(a)                      # a strided view is copied in run(), once the library checked it
        return out

    def run(self, *arrays, num_threads: int | None = None, **named) -> list[np.ndarray]:
        """Runs the model on numpy arrays given in input order and/or by name; returns the outputs in order."""
        self._ensure_open()
        xs = self._collect(arrays, named)
        for d in self.outputs:
            if d.dtype is None:
                raise CuvilError(f"{os.path.basename(self.path)}: output {d.name!r} has dtype code {d.code}, "
                                 f"which numpy cannot hold")
        with self._lock:
            s = self._get_session(num_threads)
            ins, keep = self._in_tensors, []
            copies = [k for k, a in enumerate(xs) if not (a.flags.c_contiguous and a.flags.aligned)]
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
            if copies:
                # A strided view or unaligned buffer is copied, but only after the library has checked every
                # input's shape (output_shape reads no data): a dim the loader could not check (no manifest)
                # must not make numpy allocate first. The view's pointer is never read before the copy.
                if self.outputs:
                    self._check(self._f.output_shape(s, ins, 0, self._out_shapes[0]))
                for k in copies:
                    xs[k] = np.require(xs[k], requirements=("C_CONTIGUOUS", "ALIGNED"))
                    ins[k].data = xs[k].ctypes.data or None
            if self._static_outputs:
                shapes = [d.shape for d in self.outputs]       # checked at load
            else:
                shapes = []
                for j, d in enumerate(self.outputs):
                    shape = self._out_shapes[j]
                    self._check(self._f.output_shape(s, ins, j, shape))
                    shapes.append(tuple(shape[k] for k in range(d.ndim)))
                self._check_output_sizes(shapes)
            outs = []
            for j, d in enumerate(self.outputs):
                y = np.empty(shapes[j], dtype=d.dtype)
                outs.append(y)
                self._out_tensors[j].data = y.ctypes.data or None
            self._check(self._f.run(s, ins, self._out_tensors))
            del keep
            if not self._static_outputs:   # sizes computed from the values (NonZero): the run wrote the dims
                for j, d in enumerate(self.outputs):
                    dims = tuple(self._out_shapes[j][k] for k in range(d.ndim))
                    if dims != shapes[j]:   # the first prod(dims) elements, row-major
                        outs[j] = outs[j].reshape(-1)[:int(np.prod(dims, dtype=np.int64))].reshape(dims).copy()
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


def _shape_text(shape) -> str:
    return "[" + ", ".join("?" if v is None else str(v) for v in shape) + "]"


def load(path: str, prefix: str | None = None, num_threads: int = 0, max_output_bytes: int | None = None) -> Model:
    """Loads ``lib<name>.so``. ``prefix`` defaults to the manifest's ``"prefix"``, else ``"cuvil"``;
    ``num_threads`` (0 = all cores) is the default for the session ``run`` creates; ``max_output_bytes``
    bounds the outputs one ``run`` allocates (default: the machine's physical memory)."""
    return Model(path, prefix=prefix, num_threads=num_threads, max_output_bytes=max_output_bytes)
