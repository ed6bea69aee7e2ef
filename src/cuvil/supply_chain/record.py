"""Writing a build's SBOM and provenance beside what a target emitted: :func:`record_build`, which
:meth:`cuvil.Pipeline.compile` calls once the artifact's files are written (inside the cache entry, so a cache
hit returns them too, covered by the entry's digests)."""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Sequence

import attrs

from ..rewrite_rules.verdicts import builtin_rules, builtin_rules_dir
from .build_info import BuildInfo, RuleFile, c_compiler_version, digest_files, jsonable
from .digests import sha256_file
from .provenance import rename_in_provenance, write_provenance
from .sbom import rename_in_sbom, write_sbom


def _rule_file_name(path: str) -> str:
    """``rules/NAME.rule`` for a built-in rule file, else the file's own name (never a path of this machine:
    the provenance of the same build elsewhere must be the same)."""
    builtin = builtin_rules_dir()
    ap = os.path.abspath(path)
    if os.path.dirname(ap) == builtin:
        return "rules/" + os.path.basename(ap)
    return os.path.basename(ap)


def applied_rule_records(manifest: Mapping[str, Any]) -> Dict[str, dict]:
    """Every rule that rewrote the graph with its record: the manifest's ``rules_applied`` (graph and
    target-phase rules) and, for a GPU bundle, the ``kernel_rules`` that fired (``phase: kernel``)."""
    rules = {name: dict(rec) for name, rec in (manifest.get("rules_applied") or {}).items()}
    for name, rec in (manifest.get("kernel_rules") or {}).items():
        if rec.get("applied"):
            rules[name] = {**rec, "phase": "kernel"}
    return rules


def target_record(manifest: Mapping[str, Any]) -> Dict[str, Any]:
    """The target as built, from the manifest: the triple and, for x86, the CPU, its vector width and
    ``isa_features`` (what the code needs of the CPU that runs it); for a GPU bundle, the architecture."""
    t = manifest.get("target") or {}
    keep = ("triple", "cpu", "isa_features", "vector_bits", "arch")
    return {k: t[k] for k in keep if k in t}


def record_build(files: Mapping[str, str], sbom_path: str, provenance_path: str, manifest: Mapping[str, Any], *,
                 artifact: str, model_name: str, model_sha256: str, parameters: Mapping[str, Any],
                 rule_sources: Mapping[str, str] = {}, extra_rules: Sequence[Any] = ()) -> BuildInfo:
    """Write the SBOM (``sbom_path``) and then the provenance (``provenance_path``) of the artifact whose
    files are ``files`` (name as recorded -> path; the SBOM and provenance not among them). ``rule_sources``:
    rule name -> the ``.rule`` file it came from (the rules :meth:`Pipeline.optimize` ran); ``extra_rules``:
    other rule objects of the build (a GPU bundle's own kernel rules); the built-in rules are found by name.
    Returns the provenance's :class:`BuildInfo`."""
    rules = applied_rule_records(manifest)
    sources = {r.name: r.loc.path for r in builtin_rules()}
    sources.update({r.name: r.loc.path for r in extra_rules if getattr(r, "loc", None) is not None})
    sources.update(rule_sources)
    rule_files: Dict[str, str] = {}
    for name, rec in rules.items():
        path = sources.get(name)
        if path and os.path.isfile(path):
            rec["file"] = _rule_file_name(path)
            rule_files[rec["file"]] = sha256_file(path)
    tools = []
    if str(artifact).endswith(".so"):
        cc = c_compiler_version()
        if cc:
            tools.append(("cc", cc))
    ptxas = (manifest.get("ptxas") or {}).get("ptxas")
    if ptxas:
        tools.append(("ptxas", ptxas))
    graph_sha = manifest.get("model_sha256")
    info = BuildInfo(artifact=artifact, files=digest_files(files), model_name=model_name, model_sha256=model_sha256,
                     model_graph_sha256=graph_sha if graph_sha != model_sha256 else None,
                     parameters=jsonable(parameters), target=target_record(manifest), rules=jsonable(rules),
                     rule_files=tuple(RuleFile(n, s) for n, s in sorted(rule_files.items())), tools=tuple(tools))
    write_sbom(sbom_path, info)
    # the provenance covers the SBOM too
    info = attrs.evolve(info, files=digest_files({**files, os.path.basename(sbom_path): sbom_path}))
    write_provenance(provenance_path, info)
    return info



def rename_records(sbom_path: str, provenance_path: str, renames: Mapping[str, str]) -> None:
    """The SBOM and provenance of an artifact saved under other file names (``libcuvil.so`` saved as
    ``libdemo.so``; ``renames``: old name -> new name) rewritten to name the files as they now are; the
    other files' bytes, and so their digests, are unchanged."""
    if not (os.path.isfile(sbom_path) and os.path.isfile(provenance_path)):
        return
    rename_in_sbom(sbom_path, renames)
    rename_in_provenance(provenance_path, renames, {os.path.basename(sbom_path): sha256_file(sbom_path)})
