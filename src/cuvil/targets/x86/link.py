"""Building ``lib<name>.so`` from the pieces of an x86 artifact with the system C compiler.

    kernels.o (llvmlite)  +  weights.S (.incbin)  +  model.c (generated)  +  runtime.o, isa.o (cached objects)
        └──────────── cc -shared -O2 -fPIC -fvisibility=hidden -DCUVIL_PREFIX=<prefix> ... ───────────▶ lib<name>.so

Only the ``<prefix>_*`` ABI functions are exported: every object is compiled or declared hidden, and a linker
version script makes everything else local as well.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile

from cuvil.errors import CuvilError
from cuvil.targets.x86.model_c import generate_isa_c
from cuvil.targets.x86.model_info import ABI_FUNCTIONS, is_c_identifier

RUNTIME_DIR = os.path.dirname(os.path.abspath(__file__))
RUNTIME_C = os.path.join(RUNTIME_DIR, "runtime.c")
RUNTIME_H = os.path.join(RUNTIME_DIR, "cuvil_runtime.h")

#: Libraries an artifact may depend on at run time (sonames without version; see check_dependencies).
ALLOWED_DEPENDENCIES = ("linux-vdso", "linux-gate", "ld-linux", "libc", "libm", "libpthread")

COMPILE_FLAGS = ("-std=gnu11", "-O2", "-fPIC", "-fvisibility=hidden", "-fno-plt")
LINK_FLAGS = ("-shared", "-static-libgcc", "-Wl,--no-undefined", "-Wl,-z,noexecstack", "-Wl,-z,relro",
              "-Wl,-z,now", "-Wl,--as-needed")
LIBS = ("-lm", "-lpthread")

#: The size of the writes that put a library into the page cache (see write_library).
WRITE_BLOCK = 2 << 20


def write_library(src: str, dst: str) -> None:
    """Copy the library ``src`` to ``dst`` in 2 MiB writes, through a temporary file renamed over ``dst`` (a
    library that is already loaded is never modified in place).

    The writes' size decides how the library sits in the page cache, and so what a fresh process's first run
    costs. The linker's small writes, or ``shutil.copyfile`` (sendfile), leave 4 KiB pages, which a process
    maps 64 KiB (the kernel's fault-around) per page fault: ResNet-50's first run took 41-47 ms at 1 thread,
    in ~2,050 faults on its 131 MB of weights, against 29-30 ms for later runs. Written 2 MiB at a time, the
    file is cached in 2 MiB folios (on file systems with large folios: xfs, ext4 since Linux 6.16), which the
    kernel maps whole, one page-table entry each: the first run took 29.7 ms in 95 faults, 20.3 ms at 2 threads
    against 26.9 (/proc/PID/smaps: FilePmdMapped 131072 kB against 0; `bench/first_run.c` on the library and
    on a `dd bs=4k` copy of it). Elsewhere the copy is only an extra write.
    """
    out_dir = os.path.dirname(os.path.abspath(dst))
    fd, tmp = tempfile.mkstemp(prefix=".cuvil-", suffix=".so.tmp", dir=out_dir)
    try:
        with open(fd, "wb", buffering=0, closefd=True) as out, open(src, "rb", buffering=0) as f:
            buf = bytearray(WRITE_BLOCK)
            view = memoryview(buf)
            while (n := f.readinto(buf)) > 0:
                done = 0
                while done < n:
                    done += out.write(view[done:n])
            os.fchmod(out.fileno(), 0o755)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def exported_symbols(prefix: str) -> list[str]:
    """The dynamic symbols an artifact with this prefix exports, and nothing else."""
    return [f"{prefix}_{f}" for f in ABI_FUNCTIONS]


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise CuvilError(f"{what}: cannot run {cmd[0]!r}: {e}") from e
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        raise CuvilError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{msg}")


def _cache_path(kind: str, h) -> str:
    base = os.environ.get("CUVIL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuvil")
    return os.path.join(base, "runtime", f"{kind}-{h.hexdigest()[:24]}.o")


def _compile_cached(out: str, source: str, prefix: str, cc: str, extra_flags: tuple, what: str) -> str:
    """``source`` (a C file) compiled to ``out`` unless it is there already; written through a temporary file
    renamed into place, so a concurrent build never reads a partial object."""
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out), suffix=".o.tmp")
        os.close(fd)
        try:
            _run([cc, *COMPILE_FLAGS, f"-DCUVIL_PREFIX={prefix}", f"-I{RUNTIME_DIR}", *extra_flags, "-c", source,
                  "-o", tmp], what)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def runtime_object(prefix: str, cc: str = "cc", extra_flags: tuple = ()) -> str:
    """runtime.c compiled once per (prefix, compiler, flags, runtime source) and cached: it is the same
    object for every model, and compiling it dominated the time to build a small library."""
    h = hashlib.sha256()
    for path in (RUNTIME_C, RUNTIME_H):
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(repr((prefix, cc, COMPILE_FLAGS, extra_flags)).encode())
    return _compile_cached(_cache_path("runtime", h), RUNTIME_C, prefix, cc, extra_flags, "compiling the runtime")


def isa_object(prefix: str, isa_checks=(), cc: str = "cc", extra_flags: tuple = ()) -> str:
    """The ISA check (:func:`cuvil.targets.x86.model_c.generate_isa_c`) compiled once per (source, runtime
    header, compiler, flags) and cached like the runtime: most models of one target check the same features, and
    its ``__builtin_cpu_supports`` tests cost ~20 ms of the C compiler at every link (half of model.c's compile)."""
    src = generate_isa_c(prefix, list(isa_checks))
    h = hashlib.sha256(src.encode())
    with open(RUNTIME_H, "rb") as f:
        h.update(f.read())
    h.update(repr((prefix, cc, COMPILE_FLAGS, extra_flags)).encode())
    out = _cache_path("isa", h)
    if os.path.isfile(out):
        return out
    with tempfile.TemporaryDirectory(prefix="cuvil-isa-") as tmp:
        path = os.path.join(tmp, "isa.c")      # the object's FILE symbol: the same name whichever directory
        with open(path, "w", encoding="utf-8") as f:
            f.write(src)
        return _compile_cached(out, path, prefix, cc, extra_flags, "compiling the ISA check")


def link_shared(out_so: str, objects: list[str], model_c_src: str, weights_S: str | None, prefix: str,
                cc: str = "cc", extra_flags=(), isa_checks=()) -> None:
    """Compile runtime.c + ``model_c_src`` (+ ``weights_S``) and link them with ``objects`` and the ISA check of
    ``isa_checks`` (:func:`isa_object`; the library refuses a CPU without one of these features) into ``out_so``.

    ``objects``: paths of object files (kernels.o). ``model_c_src``: the text of model.c
    (:func:`cuvil.targets.x86.model_c.generate_model_c`). ``weights_S``: the path of an assembler file, or
    assembler source text (a string with a newline), or None; an ``.incbin`` in it should use an absolute path.
    ``extra_flags`` go to the compiler and linker (e.g. ``-g``, ``-march=native``). The result is written to a
    temporary file and renamed over ``out_so`` by :func:`write_library`, so a library that is already loaded is
    never modified in place.
    Raises CuvilError with the compiler's messages on failure.
    """
    if not is_c_identifier(prefix):
        raise CuvilError(f"prefix must be a C identifier, got {prefix!r}")
    for o in objects:
        if not os.path.isfile(o):
            raise CuvilError(f"object file {o!r} does not exist")
    out_so = os.path.abspath(out_so)
    out_dir = os.path.dirname(out_so)
    os.makedirs(out_dir, exist_ok=True)
    if shutil.which(cc) is None and not os.path.isfile(cc):
        raise CuvilError(f"C compiler {cc!r} not found (set cc=...)")

    with tempfile.TemporaryDirectory(prefix="cuvil-link-") as tmp:
        model_c = os.path.join(tmp, "model.c")
        with open(model_c, "w", encoding="utf-8") as f:
            f.write(model_c_src)
        sources = [runtime_object(prefix, cc, tuple(extra_flags)),
                   isa_object(prefix, tuple(isa_checks), cc, tuple(extra_flags)), model_c]
        if weights_S is not None:
            if "\n" in weights_S or not os.path.isfile(weights_S):
                if "\n" not in weights_S:
                    raise CuvilError(f"weights file {weights_S!r} does not exist")
                path = os.path.join(tmp, "weights.S")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(weights_S)
                weights_S = path
            sources.append(os.path.abspath(weights_S))
        version_script = os.path.join(tmp, "exports.map")
        with open(version_script, "w", encoding="ascii") as f:
            f.write("{\n  global:\n" + "".join(f"    {s};\n" for s in exported_symbols(prefix))
                    + "  local:\n    *;\n};\n")
        fd, tmp_so = tempfile.mkstemp(prefix=".cuvil-", suffix=".so.tmp", dir=out_dir)
        os.close(fd)
        try:
            cmd = [cc, *COMPILE_FLAGS, f"-DCUVIL_PREFIX={prefix}", f"-I{RUNTIME_DIR}", *extra_flags,
                   *sources, *[os.path.abspath(o) for o in objects],
                   *LINK_FLAGS, f"-Wl,--version-script={version_script}", "-o", tmp_so, *LIBS]
            _run(cmd, f"linking {os.path.basename(out_so)}")
            write_library(tmp_so, out_so)              # the linker's small writes would stay in the page cache
        finally:
            if os.path.exists(tmp_so):
                os.unlink(tmp_so)


_LDD_LINE = re.compile(r"^\s*(\S+)(?:\s+=>\s+(.*?))?\s*(?:\(0x[0-9a-fA-F]+\))?\s*$")


def check_dependencies(so_path: str) -> list[str]:
    """The shared libraries ``so_path`` loads, as ``ldd`` names them (e.g. ``libc.so.6``, ``linux-vdso.so.1``,
    ``/lib64/ld-linux-x86-64.so.2``). A library ldd cannot find is reported as ``NAME (not found)``."""
    if not os.path.isfile(so_path):
        raise CuvilError(f"{so_path!r} does not exist")
    try:
        proc = subprocess.run(["ldd", os.path.abspath(so_path)], capture_output=True, text=True)
    except OSError as e:
        raise CuvilError(f"cannot run ldd: {e}") from e
    if proc.returncode != 0:
        raise CuvilError(f"ldd {so_path}: {(proc.stderr or proc.stdout).strip()}")
    libs = []
    for line in proc.stdout.splitlines():
        if not line.strip() or "statically linked" in line:
            continue
        m = _LDD_LINE.match(line)
        if not m:
            continue
        name, target = m.group(1), (m.group(2) or "")
        libs.append(f"{name} (not found)" if target.strip() == "not found" else name)
    return libs


def unexpected_dependencies(libs: list[str]) -> list[str]:
    """The entries of ``check_dependencies`` that are not libc, libm, libpthread, the loader or the vDSO."""
    def ok(lib: str) -> bool:
        base = os.path.basename(lib.split(" ")[0])
        stem = base.split(".so")[0]
        return not lib.endswith("(not found)") and any(stem == a or stem.startswith(a + "-") for a in ALLOWED_DEPENDENCIES)
    return [lib for lib in libs if not ok(lib)]
