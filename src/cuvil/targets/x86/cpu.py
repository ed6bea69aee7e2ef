"""The CPU an x86 library is built for: this machine's (identified from cpuid) or one named with ``--cpu``,
as one immutable :class:`CpuDescription` whose ISA features decide the kernels' vector width.

* The host: vendor, brand string, family/model/stepping from ``/proc/cpuinfo`` (the kernel's copy of cpuid),
  the ISA features from LLVM's cpuid reader (``llvm.get_host_cpu_features``, which also checks that the OS
  saves the AVX/AVX-512 registers), cross-checked with the kernel's ``flags``. LLVM's host CPU *name* is only
  its guess from family/model numbers (it named a Sapphire Rapids-class Xeon VM reporting model 167
  ``rocketlake``); where the CPU has features that guess lacks (AMX, AVX512-FP16), the name is the LLVM CPU
  that covers the most of them (:func:`tuning_name`, ``sapphirerapids``-class there). The name picks LLVM's
  scheduling model only: what the library may execute is the explicit cpuid feature list, never the name's.
* A named CPU (``--cpu znver4``): its features are LLVM's own definition of that CPU, read back through the
  inliner's feature-compatibility check (:func:`llvm_cpu_features`); the names LLVM accepts come from LLVM's
  ``-mcpu=help`` listing (:func:`llvm_cpu_names`). No table of CPU names in Cuvil: a CPU LLVM learns about
  (``diamondrapids``) gets the right width on the day llvmlite ships it.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from typing import Dict, FrozenSet, Iterable, Optional, Tuple

import attrs
import llvmlite.binding as llvm

from ...errors import CuvilError
from ..llvm.module import initialize_native

#: ``--cpu`` values meaning "this machine".
HOST_NAMES = ("native", "host")
#: The features that decide the vector width, spelled the same by LLVM and Linux's /proc/cpuinfo ``flags``
#: (most others differ: ``sse4.1``/``sse4_1``, ``pclmul``/``pclmulqdq``), so the two readings can be compared.
WIDTH_FEATURES = ("avx512f", "avx2", "fma")
#: Features a library's own C code checks at session creation (``__builtin_cpu_supports``), so that a C program
#: gets CUVIL_ERR_UNSUPPORTED instead of SIGILL: the ones GCC (since 6) and Clang both know, spelled as LLVM
#: spells them. The vector-width ones come first: they are the likeliest to be missing.
C_CHECKED_FEATURES = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx2", "fma", "fma4", "xop", "avx",
                      "bmi", "bmi2", "popcnt", "sse4a", "sse4.2", "sse4.1", "ssse3", "sse3")
#: Suggested when a name is refused or a library does not fit this CPU: a portable AVX2 build.
PORTABLE_CPU = "x86-64-v3"


def vector_bits_of(features: Iterable[str]) -> int:
    """The vector width Cuvil's kernels use on a CPU with ISA ``features`` (LLVM spellings, no ``+``): 512 with
    AVX-512 Foundation (the masked loads/stores and 16-lane FMAs the micro-kernels use), 256 with AVX2 and FMA
    (the 8-lane FMA micro-kernels need both), else 128 (SSE)."""
    feats = set(features)
    if "avx512f" in feats:
        return 512
    if "avx2" in feats and "fma" in feats:
        return 256
    return 128


@attrs.frozen
class CpuDescription:
    """A CPU as Cuvil generates code for it.

    ``llvm_name``: the CPU name the LLVM target machine gets (for the host, LLVM's guess, used only for its
    scheduling model); ``features``: the ISA features enabled (LLVM spellings), which is what the library may
    use and therefore needs; ``is_host``: this machine (features from cpuid) rather than a named CPU (features
    from LLVM's definition). ``vendor``, ``model_name`` (the brand string), ``family``/``model``/``stepping``:
    the host's identity from cpuid, empty/None for a named CPU. ``notes``: where the kernel's flags and LLVM's
    cpuid reading disagreed, and what was done (the feature left out).
    """

    llvm_name: str
    features: FrozenSet[str]
    is_host: bool
    vendor: str = ""
    model_name: str = ""
    family: Optional[int] = None
    model: Optional[int] = None
    stepping: Optional[int] = None
    notes: Tuple[str, ...] = ()
    #: the feature string the target machine gets ("+avx2,-avx512f,..."; "" for a named CPU: the name implies them)
    llvm_features: str = ""

    @property
    def vector_bits(self) -> int:
        """The kernels' vector width, from the features (:func:`vector_bits_of`)."""
        return vector_bits_of(self.features)

    def label(self) -> str:
        """One line for reports and benchmark tables: ``AMD EPYC 9B45 (family 26, model 2, stepping 1)``, or for
        a named CPU ``znver4 (named)``."""
        if not self.is_host:
            return f"{self.llvm_name} (named)"
        ident = ", ".join(f"{k} {v}" for k, v in (("family", self.family), ("model", self.model),
                                                   ("stepping", self.stepping)) if v is not None)
        return (self.model_name or self.vendor or "unknown x86-64 CPU") + (f" ({ident})" if ident else "")


# ------------------------------------------------------------------------------------------------ the host

def _read_cpuinfo(path: str = "/proc/cpuinfo") -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where it cannot be read)."""
    fields: Dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def describe_host(cpuinfo: Optional[Dict[str, str]] = None, llvm_features: Optional[Dict[str, bool]] = None,
                  llvm_guess: Optional[str] = None) -> CpuDescription:
    """This machine's CPU (``cpuinfo``/``llvm_features``/``llvm_guess`` stand in for /proc/cpuinfo, LLVM's cpuid
    reading and LLVM's host CPU name in tests); the LLVM name tuned for is :func:`tuning_name`'s. A width-deciding feature LLVM reports but the kernel's flags lack (disabled by the kernel, e.g.
    ``clearcpuid``) is left out, and said in ``notes``."""
    initialize_native()
    info = _read_cpuinfo() if cpuinfo is None else cpuinfo
    fmap = dict(llvm.get_host_cpu_features()) if llvm_features is None else dict(llvm_features)
    notes = []
    flags = set(info.get("flags", "").split())
    if flags:
        for f in WIDTH_FEATURES:
            if fmap.get(f) and f not in flags:
                fmap[f] = False
                notes.append(f"cpuid reports {f} but the kernel's flags lack it: not used")
            elif f in flags and not fmap.get(f):
                notes.append(f"the kernel's flags list {f} but LLVM's cpuid reading does not (OS support?): not used")
    features = frozenset(k for k, v in fmap.items() if v)
    guess = llvm.get_host_cpu_name() if llvm_guess is None else llvm_guess
    name = tuning_name(guess, features)
    if name != guess:
        notes.append(f"LLVM guessed {guess!r} from the family/model numbers, a CPU without some of this one's "
                     f"features: tuned for {name!r} (the library's instructions still follow cpuid's features)")
    return CpuDescription(
        llvm_name=name, features=features, is_host=True, vendor=info.get("vendor_id", ""),
        model_name=info.get("model name", ""), family=_int_or_none(info.get("cpu family")),
        model=_int_or_none(info.get("model")), stepping=_int_or_none(info.get("stepping")), notes=tuple(notes),
        llvm_features=",".join(("+" if v else "-") + k for k, v in sorted(fmap.items())))


def tuning_name(guess: str, features: FrozenSet[str]) -> str:
    """The LLVM CPU name to tune a host with cpuid ``features`` for: LLVM's ``guess`` unless the host has features
    the guess lacks (LLVM's guess goes by family/model numbers, which a VM may report for an older core), then
    the LLVM CPU that has the most of the host's features, fewest it lacks next (a VM hides some: ``pconfig``,
    ``waitpkg``), then by name (``emeraldrapids`` and ``sapphirerapids`` are one definition in LLVM); a name
    must have every host feature the guess has. The name only chooses LLVM's scheduling model and tuning flags:
    the target machine still gets the explicit feature list, and the library requires exactly ``features``.
    The answer is kept under ``$CUVIL_CACHE_DIR/cpu-names`` (the probes take a second or two)."""
    initialize_native()
    readable = sorted(llvm.get_host_cpu_features())
    key = hashlib.sha256(repr((llvm.llvm_version_info, guess, sorted(features), readable)).encode()).hexdigest()
    path = os.path.join(os.environ.get("CUVIL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "cuvil"),
                        "cpu-names", key[:32])
    try:
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)["name"]
        if isinstance(cached, str) and re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", cached):
            return cached
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        name = _tuning_name(guess, features, readable)
    except CuvilError:        # LLVM's CPU listing could not be read: its guess still tunes (nothing to refuse)
        return guess
    try:                # the probes take a second or two: one answer per LLVM, guess and feature set
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + f".{os.getpid()}", "w", encoding="utf-8") as f:
            json.dump({"name": name, "guess": guess}, f)
        os.replace(path + f".{os.getpid()}", path)
    except OSError:
        pass
    return name


def _tuning_name(guess: str, features: FrozenSet[str], readable) -> str:
    mine = features & _feature_table((guess,), readable)[guess]
    extra = sorted(features - mine)
    if not extra:
        return guess
    # One probe of every name for the features the guess lacks, then every feature for the names with most.
    firsts = _feature_table(llvm_cpu_names(), extra)
    best = max(len(f) for f in firsts.values())
    table = _feature_table(tuple(n for n, f in firsts.items() if best and len(f) == best), readable)
    ranked = sorted((-len(f & features), len(f - features), n) for n, f in table.items() if mine <= f)
    if not ranked or -ranked[0][0] <= len(mine):
        return guess
    return ranked[0][2]


def _feature_table(names: Iterable[str], wanted: Iterable[str]) -> Dict[str, FrozenSet[str]]:
    """Which of the features ``wanted`` LLVM gives each CPU of ``names`` (ones it lists), all in one module run
    through the inliner once: a caller per name, a callee per (name, feature) (the probe of
    :func:`llvm_cpu_features`). ``+64bit`` on every function: LLVM aborts on a 32-bit CPU (``i686``) in an
    x86-64 module without it; such a CPU has none of the features worth tuning for anyway."""
    initialize_native()
    wanted, names = list(wanted), list(names)
    triple = llvm.get_process_triple()
    lines, attrs = [f'target triple = "{triple}"'], []
    for i, name in enumerate(names):
        base = len(attrs)
        attrs.append(f'"target-cpu"="{name}" "target-features"="+64bit"')
        for k, f in enumerate(wanted):
            attrs.append(f'"target-cpu"="{name}" "target-features"="+64bit,+{f}"')
            lines.append(f'define internal void @f{i}_{k}() #{base + k + 1} {{\n'
                         f'  call void asm sideeffect "", ""()\n  ret void\n}}')
        lines.append(f"define void @probe{i}() #{base} {{")
        lines += [f"  call void @f{i}_{k}()" for k in range(len(wanted))]
        lines += ["  ret void", "}"]
    lines += [f"attributes #{j} = {{ {a} }}" for j, a in enumerate(attrs)]
    mod = llvm.parse_assembly("\n".join(lines))
    tm = llvm.Target.from_triple(triple).create_target_machine(opt=1)
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=1))
    pb.getModulePassManager().run(mod, pb)
    out = {}
    for i, name in enumerate(names):
        left = {int(k) for k in re.findall(rf"@f{i}_(\d+)\(", str(mod.get_function(f"probe{i}")))}
        out[name] = frozenset(f for k, f in enumerate(wanted) if k not in left)
    return out


@functools.cache
def host_cpu() -> CpuDescription:
    """This machine's CPU (read once per process)."""
    return describe_host()


def cpu_label() -> str:
    """The host CPU in one line (brand string and cpuid family/model/stepping), for benchmark results."""
    return host_cpu().label()


# ------------------------------------------------------------------------------------------ named CPUs

def _ask_llvm(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` (after LLVM's host target is initialised) in a child Python: what LLVM does there may abort."""
    prelude = ("import sys; import llvmlite.binding as l; l.initialize_native_target(); "
               "l.initialize_native_asmprinter(); t = l.Target.from_triple(l.get_process_triple()); ")
    try:
        return subprocess.run([sys.executable, "-c", prelude + code, *args], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise CuvilError(f"cannot ask LLVM about x86 CPUs: {e}",
                         hint="leave --cpu out (this machine's CPU) or check the llvmlite installation") from None


@functools.cache
def llvm_cpu_names() -> Tuple[str, ...]:
    """The CPU names LLVM's x86 backend knows, from its ``-mcpu=help`` listing: LLVM prints it on stderr when a
    target machine is made for the CPU ``help`` (and aborts if that machine is then used)."""
    out = _ask_llvm("t.create_target_machine(cpu='help')")
    names = _parse_cpu_help(out.stderr)
    if not names:
        raise CuvilError("cannot list the CPU names LLVM knows: llvmlite printed no CPU listing",
                         details=out.stderr.strip().splitlines()[-3:],
                         hint="leave --cpu out (this machine's CPU) or check the llvmlite installation")
    return names


def _parse_cpu_help(text: str) -> Tuple[str, ...]:
    """The names under "Available CPUs for this target:" in LLVM's help text."""
    _, found, rest = text.partition("Available CPUs for this target:")
    if not found:
        return ()
    block = rest.split("Available features for this target:", 1)[0]
    return tuple(sorted(m.group(1) for m in re.finditer(r"^\s+(\S+)\s+- ", block, re.M)))


@functools.cache
def _has_64bit_mode(name: str) -> bool:
    """Whether LLVM can generate x86-64 code for the CPU ``name`` (one it lists): for a 32-bit CPU (``i686``)
    it aborts ("64-bit code requested on a subtarget that doesn't support it"), so it is tried in a child."""
    out = _ask_llvm("tm = t.create_target_machine(cpu=sys.argv[1]); "
                    "tm.emit_object(l.parse_assembly('define void @f() {\\n ret void\\n}'))", name)
    return out.returncode == 0


@functools.cache
def llvm_cpu_features(name: str) -> FrozenSet[str]:
    """The ISA features LLVM gives the x86-64 CPU ``name`` (checked by :func:`validate_cpu`), among the
    features LLVM can read from cpuid. llvmlite has no call that returns them, so they are read back from LLVM
    itself: one caller for ``name`` and, per feature F, a trivial callee for ``name`` plus F; the x86 inliner
    inlines a callee only where the caller has every feature the callee has, so the calls inlined are the
    CPU's features."""
    validate_cpu(name)
    initialize_native()
    candidates = sorted(llvm.get_host_cpu_features())     # the keys: every feature LLVM reads from cpuid
    triple = llvm.get_process_triple()
    lines = [f'target triple = "{triple}"']
    for k in range(len(candidates)):
        lines.append(f'define internal void @f{k}() #{k + 1} {{\n  call void asm sideeffect "", ""()\n  ret void\n}}')
    lines.append("define void @probe() #0 {")
    lines += [f"  call void @f{k}()" for k in range(len(candidates))]
    lines += ["  ret void", "}", f'attributes #0 = {{ "target-cpu"="{name}" }}']
    lines += [f'attributes #{k + 1} = {{ "target-cpu"="{name}" "target-features"="+{f}" }}'
              for k, f in enumerate(candidates)]
    mod = llvm.parse_assembly("\n".join(lines))
    tm = llvm.Target.from_triple(triple).create_target_machine(cpu=name, opt=1)
    pb = llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=1))
    pb.getModulePassManager().run(mod, pb)
    left = {int(k) for k in re.findall(r"@f(\d+)\(", str(mod.get_function("probe")))}
    return frozenset(f for k, f in enumerate(candidates) if k not in left)


def is_host_name(cpu: Optional[str]) -> bool:
    """Whether a ``--cpu`` value means this machine (None, ``native``, ``host``)."""
    return cpu is None or cpu in HOST_NAMES


def validate_cpu(cpu: Optional[str]) -> Optional[str]:
    """``cpu`` if it is a ``--cpu`` value Cuvil can build for: None or ``native``/``host`` (this machine), or an
    x86-64 CPU name LLVM knows. Anything else raises :class:`CuvilError` with the nearest valid names, before
    LLVM sees it (LLVM would only warn, then abort)."""
    if is_host_name(cpu):
        return cpu
    hint = f"--cpu native for this machine, or a CPU name LLVM knows (e.g. znver5, sapphirerapids, {PORTABLE_CPU})"
    if not isinstance(cpu, str) or not cpu:
        raise CuvilError(f"--cpu takes a CPU name, got {cpu!r}", hint=hint)
    names = llvm_cpu_names()
    if cpu not in names:
        near = difflib.get_close_matches(cpu, names + HOST_NAMES, n=5, cutoff=0.5)
        raise CuvilError(f"unknown CPU {cpu!r} (--cpu)", hint=hint,
                         details=[f"nearest names: {', '.join(near)}"] if near else [])
    if not _has_64bit_mode(cpu):
        raise CuvilError(f"CPU {cpu!r} (--cpu) has no 64-bit mode; the x86_64-linux-gnu target needs an x86-64 CPU",
                         hint=f"--cpu native, or --cpu {PORTABLE_CPU} for a library that runs on any x86-64 CPU "
                              "with AVX2")
    return cpu


def describe_cpu(cpu: Optional[str] = None) -> CpuDescription:
    """The CPU a ``--cpu`` value stands for (checked by :func:`validate_cpu`): this machine's for None,
    ``native`` or ``host``, else the named CPU with LLVM's features for it."""
    if is_host_name(validate_cpu(cpu)):
        return host_cpu()
    return CpuDescription(llvm_name=cpu, features=llvm_cpu_features(cpu), is_host=False)


# ------------------------------------------------------------------------------ what a library requires

def missing_features(required: Iterable[str], cpu: Optional[CpuDescription] = None) -> Tuple[str, ...]:
    """The features of ``required`` that ``cpu`` (default this machine) lacks, sorted."""
    have = (cpu or host_cpu()).features
    return tuple(sorted(set(required) - have))


#: What LLVM's portable x86-64 levels ask of a CPU, for hints.
_LEVEL_NEEDS = {PORTABLE_CPU: " with AVX2 and FMA", "x86-64-v2": " with SSE4.2 and POPCNT", "x86-64": ""}


def portable_cpu() -> str:
    """The most capable of LLVM's portable x86-64 levels this machine runs (``x86-64-v3``: AVX2 and FMA, else
    ``x86-64-v2``, else ``x86-64``): the ``--cpu`` that builds a library for this CPU and every CPU like it."""
    for level in (PORTABLE_CPU, "x86-64-v2"):
        if not missing_features(llvm_cpu_features(level)):
            return level
    return "x86-64"


def check_runs_here(required: Iterable[str], what: str, built_for: str = "", uses: Optional[Dict[str, str]] = None) -> None:
    """Refuse (:class:`CuvilError`) a library built with ISA features this CPU lacks: running it would end in
    SIGILL at the first such instruction. ``what`` names the library, ``built_for`` its CPU; ``uses``: for
    features some of its kernels need by name, what uses them (said when the feature is missing)."""
    missing = missing_features(required)
    if missing:
        shown = ", ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
        level = portable_cpu()
        raise CuvilError(
            f"{what} was built for {built_for or 'another CPU'} and may use instructions this CPU lacks: {shown}",
            details=[f"this CPU: {cpu_label()}"] + [f"{f}: {why}" for f, why in (uses or {}).items() if f in missing],
            hint=f"recompile the model on this machine (cuvil compile MODEL -o OUT --cpu native), or anywhere with "
                 f"--cpu {level} for a library that runs on every x86-64 CPU{_LEVEL_NEEDS[level]}")
