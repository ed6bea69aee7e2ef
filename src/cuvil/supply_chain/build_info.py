"""What the SBOM and the provenance say about one build: the input model, the parameters, the rules and
their proofs, the target and the tools, gathered by :meth:`cuvil.Pipeline.compile` into a
:class:`BuildInfo`. Everything in it is a function of the build's inputs (no time, no host path), so that
two builds of the same inputs write the same bytes."""
from __future__ import annotations

import functools
import importlib.metadata
import shutil
import subprocess
from typing import Any, Dict, List, Mapping, Optional, Tuple

import attrs

from ..version import __version__
from .digests import sha256_file

#: The Python packages a build runs (importing, proving, generating code, writing the SBOM): each is named
#: with its installed version in the SBOM. The test and benchmark extras are not part of a build.
BUILD_PACKAGES = ("onnx", "protobuf", "numpy", "ml_dtypes", "llvmlite", "z3-solver", "lark", "attrs", "PyYAML",
                  "cyclonedx-python-lib")


@attrs.frozen
class RuleFile:
    """A ``.rule`` file a build's rules came from: ``name`` as the provenance names it (``rules/NAME.rule``
    for a built-in one, the file name for the user's), its sha256."""
    name: str
    sha256: str


@attrs.frozen
class BuildInfo:
    """One build, as its SBOM and provenance record it.

    ``artifact``: the library's or bundle's name (``libNAME.so``, ``NAME.cuvil``); ``files``: the artifact's
    files, name -> sha256 (the SBOM and provenance themselves left out); ``model_name`` / ``model_sha256``:
    the input model as given (a file's name and the sha256 of its bytes); ``model_graph_sha256``: the sha256 of
    the ONNX model as imported, external data included (the manifest's ``model_sha256``); ``parameters``: the
    build's external parameters (target, options, fixed symbols, shape profiles); ``target``: the target as
    built (triple, CPU and the ISA features the code needs, or the GPU architecture); ``rules``: each rule
    that rewrote the graph, with its record (times applied, obligation, verdict); ``rule_files``;
    ``tools``: (name, version) of the external tools run (the C compiler and linker, ptxas)."""
    artifact: str
    files: Mapping[str, str]
    model_name: str
    model_sha256: str
    model_graph_sha256: Optional[str]
    parameters: Mapping[str, Any]
    target: Mapping[str, Any]
    rules: Mapping[str, Mapping[str, Any]]
    rule_files: Tuple[RuleFile, ...] = ()
    tools: Tuple[Tuple[str, str], ...] = ()
    compiler_version: str = __version__


@functools.lru_cache(maxsize=None)
def package_versions() -> Tuple[Tuple[str, str], ...]:
    """``(name, version)`` of each of :data:`BUILD_PACKAGES` that is installed, in that order. Looked up once per
    process: the packages a process has imported do not change under it, and the lookups (importlib.metadata
    scanning sys.path) cost ~0.1 s, a quarter of the build record of a small model."""
    out = []
    for name in BUILD_PACKAGES:
        try:
            out.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            pass
    return tuple(out)


@functools.lru_cache(maxsize=None)
def c_compiler_version(cc: str = "cc") -> Optional[str]:
    """The first line of ``cc --version`` (``cc (Debian 12.2.0-14) 12.2.0``): the compiler and, through it,
    the linker the x86 target builds with; None where it cannot be run."""
    exe = shutil.which(cc)
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


#: What the records say for an option whose value is a secret (an attrs field with ``repr=False``).
SECRET = "(given; a secret, not recorded)"


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON data, deterministically: attrs objects as dicts (a field with ``repr=False`` as
    :data:`SECRET`), rules by name, tuples and sets as lists (sets sorted), anything else by its ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "loc") and hasattr(value, "name") and hasattr(value, "lhs"):   # a dsl Rule
        return value.name
    if attrs.has(type(value)):
        # a field kept out of the object's repr is a secret (encrypt_weights: a key or its file): recorded
        # only as given or not, never its value (nor a key file's path, a path of the build machine)
        return {f.name: jsonable(getattr(value, f.name)) if f.repr or getattr(value, f.name) is None else SECRET
                for f in attrs.fields(type(value))}
    return repr(value)


def digest_files(files: Mapping[str, str]) -> Dict[str, str]:
    """``{name: sha256}`` of ``{name: path}``, sorted by name."""
    return {name: sha256_file(files[name]) for name in sorted(files)}
