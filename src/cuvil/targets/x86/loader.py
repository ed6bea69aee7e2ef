"""Running an x86 artifact ``lib<name>.so`` from Python through its C ABI (ctypes; no recompilation).

    m = load("libnet.so")            # prefix from libnet.manifest.json ("prefix"), else "cuvil"
    (y,) = m.run(x)                  # or m.run(data=x); or m.run({"data": x}) -> {"y": ...}
    m.close()                        # or `with load(...) as m:`

:class:`X86Model` is the x86 side of the one model interface (:mod:`cuvil.targets.model_api`): the call
forms, the metadata and the input checks are the ones a GPU bundle's model has. Nothing is converted
silently: arrays go to the library as they are (made contiguous and aligned if needed, never cast). Each
input's dtype, rank, static dims and profile range are checked first (``Signature.prepare``), with a
ShapeError that names the input and says what to pass instead; the library validates again and its error
becomes a ShapeError that carries ``<prefix>_strerror`` and ``<prefix>_last_error``. Output buffers are
allocated only after their shapes were checked and their size against ``Model.max_output_bytes``. A closed
model raises CuvilError.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading

import attrs
import numpy as np

from cuvil import audit
from cuvil.errors import CuvilError, ShapeError
from cuvil.ir.dim import is_symbol_name
from cuvil.lora.adapter import read_adapter
from cuvil.lora.mapping import suffix_score
from cuvil.targets import model_api
from cuvil.supply_chain.digests import sha256_file
from cuvil.targets.model_api import (Signature, SymbolProfile, TensorSpec, dtype_code, fixed_symbols, shape_text,
                                    tensor_spec)
from cuvil.targets.x86.bound_weights import bind_external_weights
from cuvil.targets.x86.weights_file import WeightsRefused
from cuvil.targets.x86.cpu import check_runs_here
from cuvil.targets.x86.model_info import is_c_identifier


class CTensor(ctypes.Structure):
    """``cuvil_tensor``."""
    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.POINTER(ctypes.c_int64))]


#: What the loader called its input/output descriptions before both targets shared one.
IOSpec = TensorSpec

#: Runtime codes that mean the session handle itself is unusable (not the inputs): CUVIL_ERR_NULL_SESSION,
#: CUVIL_ERR_BUSY, CUVIL_ERR_BAD_SESSION.
_SESSION_CODES = (-1, -13, -20)

#: ``run``'s ``adapter`` when the call gives none (None means the base model).
_UNSET = object()


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
        raise CuvilError(f"{mp}: unreadable manifest: {e}", hint="compile the model again (cuvil compile MODEL -o libNAME.so): the manifest is written beside the library") from e
    if not isinstance(manifest, dict):
        raise CuvilError(f"{mp}: unreadable manifest: not a JSON object", hint="compile the model again (cuvil compile MODEL -o libNAME.so): the manifest is written beside the library")
    return manifest


def _check_isa(manifest: dict, path: str) -> None:
    """Refuse, before the library is mapped, one built with ISA features this CPU lacks (the manifest's
    ``target.isa_features``; older manifests have none and are not checked)."""
    target = manifest.get("target")
    required = target.get("isa_features") if isinstance(target, dict) else None
    if isinstance(required, list):
        bf16 = sum(1 for st in manifest.get("steps", []) if isinstance(st, dict) and st.get("path") == "avx512_bf16")
        amx = sum(1 for st in manifest.get("steps", []) if isinstance(st, dict) and st.get("path") == "amx_bf16")
        uses = {"avx512bf16": f"{bf16} bf16 kernels run vdpbf16ps (AVX512_BF16); a build on this CPU keeps those "
                              "nodes float32"} if bf16 else {}
        if amx:
            uses["amx-bf16"] = uses["amx-tile"] = (f"{amx} bf16 kernels run tdpbf16ps on AMX tiles; a build on this "
                                                   "CPU takes AVX512_BF16 or keeps those nodes float32")
        fp16 = sum(1 for st in manifest.get("steps", []) if isinstance(st, dict) and st.get("path") == "f16c")
        if fp16:
            uses["f16c"] = uses["avx512fp16"] = (f"{fp16} fp16 kernels widen float16 weights (vcvtph2ps); a build on "
                                                 "this CPU uses the instructions it has")
        uses = uses or None
        check_runs_here([str(f) for f in required], os.path.basename(path), str(target.get("cpu", "")), uses)


def _manifest_dims(manifest: dict, key: str, k: int, spec: TensorSpec, plain: bool) -> tuple:
    """Per dim of ``manifest[key][k]``, the name the manifest gives a symbolic dim (a plain symbol; with
    ``plain=False`` an expression too, as an output's ``2*N``), else the library's dim."""
    try:
        shape = manifest[key][k]["shape"]
    except (KeyError, IndexError, TypeError):
        return spec.shape
    if not isinstance(shape, list) or len(shape) != spec.ndim:
        return spec.shape
    return tuple(v if want is None and isinstance(v, str) and (not plain or is_symbol_name(v)) else want
                 for v, want in zip(shape, spec.shape))


_POOL_MIN_BYTES = 1 << 18   # outputs from 256 KiB up come from the model's pool (smaller: numpy's allocator)
_POOL_BLOCKS = 64           # blocks a model's pool keeps


def _address(a: np.ndarray):
    """The data pointer of ``a`` for a CTensor (None for no data). ``a.ctypes.data`` builds numpy's ctypes
    helper and array interface, 2-3 us a call: most of a small model's run; a writable C-contiguous array's
    buffer gives the same address in a fraction of that. Not for the dtypes numpy cannot export through the
    buffer protocol (ml_dtypes' float8, float4, int4, bfloat16: their type chars are not buffer formats)."""
    if a.nbytes and a.flags.writeable and a.flags.c_contiguous and a.dtype.isbuiltin == 1:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))
    return a.ctypes.data or None


class X86Model(model_api.Model):
    """A loaded ``libNAME.so`` (:class:`cuvil.targets.model_api.Model`: ``run``, ``inputs``, ``outputs``,
    ``symbols``). One lazily created session (``num_threads``, 0 = all cores; ``run(..., num_threads=N)`` for
    one call) serves ``run``; calls to ``run`` from several Python threads are serialised by a lock. After
    ``close()`` (or the end of a ``with`` block) the model raises CuvilError; load the library again to run
    it. ``max_output_bytes`` bounds what one ``run`` allocates for its outputs (default: the machine's
    physical memory)."""

    run_options = ("num_threads", "adapter")

    def __init__(self, path: str, prefix: str | None = None, num_threads: int = 0,
                 max_output_bytes: int | None = None, weights=None, weights_key=None, manifest: dict | None = None,
                 dlopen_path: str | None = None):
        self._closed = True                       # until the library is bound (close() and __del__ rely on it)
        self.path = os.path.abspath(path)
        if not os.path.isfile(self.path):
            raise CuvilError(f"{path!r} does not exist", hint="give the path of a compiled libNAME.so (cuvil compile "
                             "MODEL -o libNAME.so writes one)")
        if manifest is None:
            manifest = _read_manifest(self.path)
        _check_isa(manifest, path)
        self.manifest = manifest
        if prefix is None:
            prefix = manifest.get("prefix", "cuvil")
        self.prefix = prefix
        if not is_c_identifier(self.prefix):
            raise CuvilError(f"{path}: prefix {self.prefix!r} is not a C identifier",
                             hint="give prefix= the --prefix the library was compiled with (default cuvil)")
        try:
            self._lib = ctypes.CDLL(dlopen_path or self.path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except (OSError, UnicodeDecodeError) as e:   # dlerror() quotes a damaged symbol name: maybe not UTF-8
            raise CuvilError(f"cannot load {path}: {e}", hint="compile the model again on this machine (cuvil "
                             "compile MODEL -o libNAME.so); `cuvil doctor` shows what this machine has") from e
        self._mapped, self._digest = dlopen_path or self.path, None
        self._bind()
        self.num_threads = num_threads
        self._session = None
        self._session_threads = None
        self._lock = threading.Lock()
        # before the first session; released by close() (and so by __del__, also when a check below fails)
        self._weights = bind_external_weights(self._lib, self.prefix, self.path, weights, weights_key,
                                              from_disk=dlopen_path is None)
        self._adapters: dict = {}              # name -> bytes the library holds for it (LoRA slots)
        self._active = None                    # the adapter set_adapter chose (None: the base model)
        self._session_adapter = None           # the one active in the C session
        self._adapter_ns = f"py{id(self):x}:"  # C names of this model's adapters: unique in the process
        inputs = [self._spec(True, i) for i in range(self._f.num_inputs())]
        outputs = [self._spec(False, j) for j in range(self._f.num_outputs())]
        inputs = [attrs.evolve(d, dims=_manifest_dims(manifest, "inputs", k, d, True)) for k, d in enumerate(inputs)]
        outputs = [attrs.evolve(d, dims=_manifest_dims(manifest, "outputs", k, d, False))
                   for k, d in enumerate(outputs)]
        # the C ABI reports min/opt/max; the multiple is the manifest's (the library checks it itself)
        multiples = {name: int(s.get("multiple", 1)) for name, s in (manifest.get("symbols") or {}).items()
                     if isinstance(s, dict)}
        symbols = {name: SymbolProfile(lo, opt, hi, multiples.get(name, 1))
                   for name, (lo, opt, hi) in self._symbols().items()}
        self.signature = Signature(artifact=os.path.basename(self.path), inputs=tuple(inputs),
                                   outputs=tuple(outputs), symbols=symbols, fixed=fixed_symbols(manifest))
        self._in_tensors = (CTensor * max(1, len(inputs)))()
        self._out_tensors = (CTensor * max(1, len(outputs)))()
        # Shape arrays handed to the library, reused across runs (filled under the lock).
        self._in_shapes = [(ctypes.c_int64 * max(1, d.ndim))() for d in inputs]
        for t, shape in zip(self._in_tensors, self._in_shapes):
            t.shape = shape
        self._swapped_shapes = False
        self._pool: list = []       # blocks large outputs are carved from (_output_array)
        self._last_out = None       # (input dtypes and shapes, output sizes) of the last run of a symbolic model
        self._out_shapes = [(ctypes.c_int64 * max(1, d.ndim))() for d in outputs]
        for t, d, shape in zip(self._out_tensors, outputs, self._out_shapes):
            t.dtype, t.ndim, t.shape = d.code, d.ndim, shape
            shape[:d.ndim] = [-1 if v is None else v for v in d.shape]
        self._static_outputs = all(v is not None for d in outputs for v in d.shape)
        self.max_output_bytes = default_max_output_bytes() if max_output_bytes is None else int(max_output_bytes)
        if self._static_outputs:
            self._check_output_sizes([d.shape for d in outputs])
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
        lora = {
            "num_lora_slots": (ctypes.c_int, []),
            "lora_slot_info": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p), i64p, i64p, i64p]),
            "adapter_load": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int32, i32p, tp, tp,
                                            ctypes.POINTER(ctypes.c_float)]),
            "adapter_activate": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]),
            "adapter_unload": (ctypes.c_int, [ctypes.c_char_p]),
            "adapter_bytes": (ctypes.c_int64, [ctypes.c_char_p]),
        }
        # libraries built before LoRA slots lack these: they have no slots
        sigs.update({k: v for k, v in lora.items() if hasattr(lib, f"{p}_{k}")})

        class _F:
            pass

        f = _F()
        for name, (res, args) in sigs.items():
            try:
                fn = getattr(lib, f"{p}_{name}")
            except (AttributeError, UnicodeDecodeError):
                raise CuvilError(f"{self.path}: no symbol {p}_{name}; not a Cuvil artifact with prefix {p!r}",
                                 hint="a Cuvil library compiled with --prefix finds it in the libNAME.manifest.json "
                                      "beside it: keep that file there (Python: cuvil.load(path, prefix=...)); any "
                                      "other library: compile the model, cuvil compile MODEL.onnx -o libNAME.so") from None
            fn.restype, fn.argtypes = res, args
            setattr(f, name, fn)
        self._f = f

    def digest(self) -> str:
        """SHA-256 (hex) of the library as mapped (the verified bytes after a verified load)."""
        if self._digest is None:
            self._digest = sha256_file(self._mapped)
        return self._digest

    @property
    def lib(self) -> ctypes.CDLL:
        """The raw ctypes library (functions ``<prefix>_*``)."""
        return self._lib

    def _spec(self, is_input: bool, i: int) -> TensorSpec:
        f = self._f
        info, name_fn = (f.input_info, f.input_name) if is_input else (f.output_info, f.output_name)
        dtype, ndim = ctypes.c_int32(), ctypes.c_int32()
        self._check(info(i, ctypes.byref(dtype), ctypes.byref(ndim), None), CuvilError)
        shape = (ctypes.c_int64 * max(1, ndim.value))()
        self._check(info(i, None, None, shape), CuvilError)
        name = name_fn(i).decode("utf-8", errors="surrogateescape")
        return tensor_spec(name, dtype.value, [int(shape[k]) for k in range(ndim.value)])

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

    def _check_output_sizes(self, shapes) -> None:
        """Every output dim >= 0 and their bytes within ``max_output_bytes``, before anything is allocated."""
        lib, total = os.path.basename(self.path), 0
        for d, dims in zip(self.signature.outputs, shapes):
            if any(v is None or v < 0 for v in dims):
                raise CuvilError(f"{lib}: output '{d.name}' has shape {shape_text(dims)}, which no array can have; "
                                 f"the library is damaged or mismatched", hint="compile the model again")
            n = d.dtype.itemsize if d.dtype is not None else 1
            for v in dims:
                n *= int(v)
            total += n
            if total > self.max_output_bytes:
                raise CuvilError(f"{lib}: output '{d.name}' of shape {shape_text(dims)} takes {n} bytes, over the "
                                 f"{self.max_output_bytes} that one run may allocate for its outputs",
                                 hint=f"run smaller inputs, or load with max_output_bytes={n} if the machine has the "
                                      f"memory")

    # -- sessions -----------------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise self.closed_error()

    def _get_session(self, num_threads: int | None):
        self._ensure_open()
        n = self.num_threads if num_threads is None else num_threads
        if self._session is not None and n == self._session_threads:
            return self._session
        if self._session is not None:
            self._f.session_destroy(self._session)
            self._session = None
            self._session_adapter = None
        s = self._f.session_create(int(n))
        if not s:
            raise CuvilError(f"{os.path.basename(self.path)}: cannot create a session with num_threads={n}: "
                             f"{(self._f.last_error() or b'').decode()}",
                             hint="give num_threads=0 (all cores) or a count up to the cores this machine has")
        self._session, self._session_threads = s, n
        audit.record("session-create", artifact=self.path, digest=self.digest, num_threads=int(n))
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
            self._pool = []
            weights, self._weights = getattr(self, "_weights", None), None
            if weights is not None:
                weights.release()
            for name in list(getattr(self, "_adapters", ())):
                self._f.adapter_unload(self._c_name(name))
            self._adapters = {}

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- running ------------------------------------------------------------------------------------

    def _output_array(self, shape, dtype) -> np.ndarray:
        """An uninitialised output array. A large one (an LLM step's present keys and values: megabytes each)
        is carved from a block of this model's pool that no array refers to any more (the caller dropped the
        outputs it was handed; any view of them keeps the block referenced), as onnxruntime's arena does: a
        fresh one would be page-faulted and zeroed by the kernel at every call (24 x 3 MB a GPT-2 step at 1,024
        keys: more time than the step's kernels)."""
        n = dtype.itemsize
        for v in shape:
            n *= int(v)
        if n < _POOL_MIN_BYTES:
            return np.empty(shape, dtype=dtype)
        pool, found = self._pool, None
        for k in range(len(pool)):
            # references: the pool's list and getrefcount's argument: no array holds the block
            if n <= pool[k].nbytes <= 2 * n and sys.getrefcount(pool[k]) == 2:
                found = pool.pop(k)
                break
        if found is None:
            found = np.empty(n, dtype=np.uint8)
            if len(pool) >= _POOL_BLOCKS:      # the oldest block nothing refers to goes back to the system
                for k in range(len(pool)):
                    if sys.getrefcount(pool[k]) == 2:
                        del pool[k]
                        break
        pool.append(found)                      # most recently used last
        return found[:n].view(dtype).reshape(shape)

    def _run_arrays(self, xs: list, num_threads: int | None = None, adapter=_UNSET) -> list:
        """One run on checked inputs (``Model.run``); ``num_threads`` for this call (None: the model's);
        ``adapter``: the LoRA adapter of this call (a loaded name, or None for the base model; default: the one
        :meth:`set_adapter` chose)."""
        xs, outputs = list(xs), self.signature.outputs
        for d in outputs:
            if d.dtype is None:
                raise CuvilError(f"{os.path.basename(self.path)}: output {d.name!r} has dtype code {d.code}, "
                                 f"which numpy cannot hold", hint="call the library from C (the header beside it "
                                 "declares cuvil_run)")
        with self._lock:
            s = self._get_session(num_threads)
            self._activate(s, self._active if adapter is _UNSET else self._known(adapter))
            ins, keep = self._in_tensors, []
            if self._swapped_shapes:   # a wrong-rank call before pointed a CTensor at its own shape array
                for t, shape in zip(ins, self._in_shapes):
                    t.shape = shape
                self._swapped_shapes = False
            copies = [k for k, a in enumerate(xs) if not (a.flags.c_contiguous and a.flags.aligned)]
            for k, a in enumerate(xs):
                shape, t = self._in_shapes[k], ins[k]
                if a.ndim > len(shape):  # wrong rank: the library reports it
                    shape = (ctypes.c_int64 * a.ndim)()
                    keep.append(shape)
                    t.shape = shape      # put back by the next call (setting a pointer field costs ~0.5 us)
                    self._swapped_shapes = True
                shape[:a.ndim] = a.shape
                t.data = _address(a)
                t.dtype = dtype_code(a.dtype)
                t.ndim = a.ndim
            if copies:
                # A strided view or unaligned buffer is copied, but only after the library has checked every
                # input's shape (output_shape reads no data): a dim the loader could not check (no manifest)
                # must not make numpy allocate first. The view's pointer is never read before the copy.
                if outputs:
                    self._check(self._f.output_shape(s, ins, 0, self._out_shapes[0]))
                for k in copies:
                    xs[k] = np.require(xs[k], requirements=("C_CONTIGUOUS", "ALIGNED"))
                    ins[k].data = xs[k].ctypes.data or None
            if self._static_outputs:
                shapes = [d.shape for d in outputs]       # checked at load
            else:
                # output_shape reads only the inputs' dtypes and shapes: the last call's sizes (and their
                # check against max_output_bytes) hold for the same ones
                key = (tuple((a.dtype, a.shape) for a in xs), self.max_output_bytes)
                last = self._last_out
                if last is not None and last[0] == key:
                    shapes = last[1]
                    for j, d in enumerate(outputs):    # a run of value-sized outputs wrote its dims there
                        self._out_shapes[j][:d.ndim] = shapes[j]
                else:
                    shapes = []
                    for j, d in enumerate(outputs):
                        shape = self._out_shapes[j]
                        self._check(self._f.output_shape(s, ins, j, shape))
                        shapes.append(tuple(shape[k] for k in range(d.ndim)))
                    self._check_output_sizes(shapes)
                    self._last_out = (key, shapes)
            outs = []
            for j, d in enumerate(outputs):
                y = self._output_array(shapes[j], d.dtype)
                outs.append(y)
                self._out_tensors[j].data = _address(y)
            self._check(self._f.run(s, ins, self._out_tensors))
            if not self._static_outputs:   # sizes computed from the values (NonZero): the run wrote the dims
                for j, d in enumerate(outputs):
                    dims = tuple(self._out_shapes[j][k] for k in range(d.ndim))
                    if dims != shapes[j]:   # the first prod(dims) elements, row-major
                        outs[j] = outs[j].reshape(-1)[:int(np.prod(dims, dtype=np.int64))].reshape(dims).copy()
        return outs

    def profile(self, *arrays, runs: int = 10, num_threads: int | None = None, warm_up: bool = True,
                **named) -> list[float]:
        """Seconds per run spent in each step (kernel) of the model, averaged over ``runs`` runs after one
        warm-up (``warm_up=False``: none, so a profile of one run after a pause sees the caches as a request
        after idle time does; the session is created first either way); the manifest's ``steps`` names them."""
        if warm_up:
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

    # -- LoRA adapters (a library compiled with lora_slots= / --lora-slots) ----------------------------

    @property
    def lora_slots(self) -> list[dict]:
        """The layers that take an adapter: ``{"module", "in", "out", "rank"}`` each ([] without slots)."""
        if not hasattr(self._f, "num_lora_slots"):
            return []
        out = []
        for k in range(self._f.num_lora_slots()):
            name, d_in, d_out, rank = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
            self._check(self._f.lora_slot_info(k, ctypes.byref(name), ctypes.byref(d_in), ctypes.byref(d_out),
                                               ctypes.byref(rank)), CuvilError)
            out.append({"module": (name.value or b"").decode("utf-8", errors="surrogateescape"), "in": d_in.value,
                        "out": d_out.value, "rank": rank.value})
        return out

    @property
    def adapters(self) -> list[str]:
        """The names of the loaded adapters, in load order."""
        return list(self._adapters)

    @property
    def active_adapter(self):
        """The adapter :meth:`set_adapter` chose, or None (the base model)."""
        return self._active

    def adapter_bytes(self, name: str) -> int:
        """The bytes the library holds for adapter ``name`` (its tensors, padded to the slot rank)."""
        self._known(name)
        n = self._f.adapter_bytes(self._c_name(name))
        self._check(n if n < 0 else 0, CuvilError)
        return int(n)

    def load_adapter(self, name: str, adapter, weight: float = 1.0) -> None:
        """Load LoRA ``adapter`` under ``name`` (not yet active: :meth:`set_adapter`). ``adapter``: a PEFT
        adapter directory or ``.onnx_adapter`` file (:func:`cuvil.lora.adapter.read_adapter`), a read
        :class:`cuvil.lora.adapter.Adapter`, or ``{module: (A [r, in], B [out, r], scale)}``. Each module must
        have a slot (its name, or a dotted suffix of it, matches one slot's module); ``weight`` multiplies
        every scale. The library copies the tensors (memory grows by the adapter's size); no recompile."""
        self._ensure_open()
        slots = self.lora_slots
        if not slots:
            raise CuvilError(f"{os.path.basename(self.path)} has no LoRA slots: it cannot take an adapter at run time",
                             hint="compile the model with --lora-slots RANK (Python: .compile(lora_slots=RANK)), or "
                                  "merge the adapter at compile time (--lora ADAPTER_DIR)")
        if not isinstance(name, str) or not name:
            raise CuvilError(f"adapter name {name!r} is not a non-empty string", hint='give a name, e.g. "sql"')
        if name in self._adapters:
            raise CuvilError(f"an adapter named {name!r} is already loaded",
                             hint=f"unload_adapter({name!r}) first, or load it under another name")
        weight = float(weight)
        if not np.isfinite(weight):
            raise CuvilError(f"weight={weight} is not finite", hint="give a finite weight, e.g. 1.0")
        entries = []
        for module, (a, b, scale) in _adapter_modules(adapter).items():
            k = _slot_of(module, slots, os.path.basename(self.path))
            a, b = np.ascontiguousarray(a, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32)
            entries.append(_check_pair(module, slots[k], a, b, os.path.basename(self.path)) + (k, float(scale) * weight))
        ks = [e[2] for e in entries]
        dup = sorted({slots[k]["module"] for k in ks if ks.count(k) > 1})
        if dup:
            raise CuvilError(f"several modules of the adapter map to the slot of {dup[0]}",
                             hint="give each module once (an adapter's module names must be distinct)")
        n = len(entries)
        idx = (ctypes.c_int32 * max(1, n))(*ks)
        ta, tb = (CTensor * max(1, n))(), (CTensor * max(1, n))()
        shapes = []
        for j, (a, b, _, _) in enumerate(entries):
            for t, x in ((ta[j], a), (tb[j], b)):
                shape = (ctypes.c_int64 * 2)(*x.shape)
                shapes.append(shape)
                t.data, t.dtype, t.ndim, t.shape = x.ctypes.data, 1, 2, shape
        scales = (ctypes.c_float * max(1, n))(*[e[3] for e in entries])
        with self._lock:
            self._ensure_open()
            self._check(self._f.adapter_load(self._c_name(name), n, idx, ta, tb, scales), CuvilError)
            self._adapters[name] = True
        del shapes

    def set_adapter(self, name) -> None:
        """Run with adapter ``name`` from now on (None: the base model, exactly). A pointer swap: no copy."""
        self._known(name)
        with self._lock:
            self._active = name
            if self._session is not None:
                self._activate(self._session, name)

    def unload_adapter(self, name: str) -> None:
        """Free adapter ``name``; if it was the active one, the model runs the base model again."""
        self._known(name)
        if name is None:
            raise CuvilError("unload_adapter(None): the base model cannot be unloaded", hint="name a loaded adapter")
        with self._lock:
            if self._session is not None and self._session_adapter == name:
                self._activate(self._session, None)
            if self._active == name:
                self._active = None
            self._check(self._f.adapter_unload(self._c_name(name)), CuvilError)
            del self._adapters[name]

    def _c_name(self, name: str) -> bytes:
        return (self._adapter_ns + name).encode("utf-8", errors="surrogateescape")

    def _known(self, name):
        """``name`` if it is None or a loaded adapter, else a CuvilError saying which are."""
        self._ensure_open()
        if name is not None and name not in self._adapters:
            loaded = ", ".join(map(repr, self._adapters)) or "none"
            raise CuvilError(f"no adapter named {name!r} is loaded (loaded: {loaded})",
                             hint=f"load it first: m.load_adapter({name!r}, ADAPTER_DIR), or None for the base model")
        return name

    def _activate(self, s, name) -> None:
        """Adapter ``name`` active in session ``s`` (held: the lock)."""
        if name == self._session_adapter:
            return
        self._check(self._f.adapter_activate(s, None if name is None else self._c_name(name)), CuvilError)
        self._session_adapter = name

    def _check_count(self, rc: int) -> int:
        if rc < 0:
            self._check(rc, CuvilError)
        return rc

    def __repr__(self) -> str:
        fmt = lambda ds: ", ".join(map(str, ds))  # noqa: E731
        return f"<cuvil.X86Model {os.path.basename(self.path)} ({fmt(self.inputs)}) -> ({fmt(self.outputs)})>"


def _adapter_modules(adapter) -> dict:
    """``{module: (A, B, scale)}`` of an adapter given as a path, an :class:`cuvil.lora.adapter.Adapter` or a
    dict of such triples."""
    if isinstance(adapter, (str, os.PathLike)):
        adapter = read_adapter(adapter)
    modules = getattr(adapter, "modules", adapter)
    if not isinstance(modules, dict) or not modules:
        raise CuvilError(f"{type(adapter).__name__} is not an adapter with modules",
                         hint="give a PEFT adapter directory, a cuvil.lora.adapter.Adapter, or "
                              "{module: (A [r, in], B [out, r], scale)}")
    out = {}
    for module, m in modules.items():
        out[str(module)] = (m.A, m.B, m.scale) if hasattr(m, "A") else tuple(m)
    return out


def _slot_of(module: str, slots: list, lib: str) -> int:
    """The slot whose module shares the most trailing dotted components with ``module``, as the compile-time
    mapping matches them (:func:`cuvil.lora.mapping.suffix_score`: the exporter's wrapper prefix ``model.``
    and the adapter's ``bert.`` may differ)."""
    scores = [suffix_score(module, s["module"]) for s in slots]
    top = max(scores)
    hits = [k for k, v in enumerate(scores) if v == top and v > 0]
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise CuvilError(f"adapter module {module!r} matches several LoRA slots of {lib}: "
                         f"{', '.join(slots[k]['module'] for k in hits[:4])}",
                         hint="give the adapter's full module names (as PEFT saves them)")
    shown = ", ".join(s["module"] for s in slots[:6]) + (f" (+{len(slots) - 6} more)" if len(slots) > 6 else "")
    leaf = module.rsplit(".", 1)[-1]
    raise CuvilError(f"adapter module {module!r} has no LoRA slot in {lib}", details=[f"slots: {shown}"],
                     hint=f"compile the model with a slot on it: --lora-targets ... {leaf} (Python: lora_targets=[..., "
                          f"{leaf!r}]), or merge this adapter at compile time (--lora ADAPTER_DIR)")


def _check_pair(module: str, slot: dict, a: np.ndarray, b: np.ndarray, lib: str) -> tuple:
    """``(A, B)`` if they fit ``slot`` (A [r, in], B [out, r], r up to the slot rank, finite), else a CuvilError."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != slot["in"] or b.shape[0] != slot["out"] or b.shape[1] != a.shape[0] \
            or a.shape[0] < 1:
        raise CuvilError(f"adapter module {module!r}: A is {list(a.shape)} and B {list(b.shape)}, the slot of "
                         f"{slot['module']} takes A [r, {slot['in']}] and B [{slot['out']}, r]",
                         hint="check that the adapter was trained for this base model (its hidden sizes)")
    if a.shape[0] > slot["rank"]:
        raise CuvilError(f"adapter module {module!r} has rank {a.shape[0]}, above the library's slot rank "
                         f"{slot['rank']} ({lib})",
                         hint=f"recompile the model with --lora-slots {a.shape[0]} (Python: lora_slots={a.shape[0]}), "
                              f"or merge this adapter at compile time (--lora ADAPTER_DIR)")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise CuvilError(f"adapter module {module!r} holds non-finite values (inf or NaN)",
                         hint="check the adapter file: training diverged or it is damaged")
    return a, b


#: The x86 model's name before both targets shared one interface (:class:`cuvil.targets.model_api.Model`).
Model = X86Model


def load(path: str, prefix: str | None = None, num_threads: int = 0, max_output_bytes: int | None = None,
         weights=None, weights_key=None, manifest: dict | None = None, dlopen_path: str | None = None) -> X86Model:
    """Loads ``lib<name>.so``. ``prefix`` defaults to the manifest's ``"prefix"``, else ``"cuvil"``;
    ``num_threads`` (0 = all cores) is the default for the session ``run`` creates; ``max_output_bytes``
    bounds the outputs one ``run`` allocates (default: the machine's physical memory). A library compiled
    with external weights binds ``libNAME.weights`` from beside it (mapped read-only, shared), or
    ``weights``, the contents of that file (bytes-like); ``weights_key`` (a key file or the key's 32 bytes)
    decrypts encrypted ones, in memory only (:mod:`cuvil.targets.x86.bound_weights`). ``manifest``: the
    parsed manifest to use instead of reading ``libNAME.manifest.json``, and ``dlopen_path``: the file to
    map instead of ``path`` (which still names the library in messages): a verified load passes the bytes
    it checked (:mod:`cuvil.targets.x86.sealed`)."""
    try:
        m = X86Model(path, prefix=prefix, num_threads=num_threads, max_output_bytes=max_output_bytes,
                     weights=weights, weights_key=weights_key, manifest=manifest, dlopen_path=dlopen_path)
    except CuvilError as e:
        audit.record("load", artifact=path, digest=lambda: sha256_file(dlopen_path or path),
                     outcome="refused" if isinstance(e, WeightsRefused) else "error", reason=e.message)
        raise
    audit.record("load", artifact=path, digest=m.digest, verified=dlopen_path is not None,
                 **({} if m._weights is None else {"weights": "encrypted" if m._weights.encrypted else "external"}))
    return m
