"""The provenance of a compiled artifact: an in-toto Statement v1 whose predicate is SLSA v1 build
provenance (https://slsa.dev/provenance/v1).

``subject``: every file of the artifact with its sha256 (the statement itself left out);
``buildDefinition``: ``buildType`` :data:`BUILD_TYPE`, ``externalParameters`` (the build's parameters, the
same whether the build ran from the CLI or the Python API: target, options, fixed symbols, shape profiles, the
model's digest), ``internalParameters`` (the target as built: CPU and ISA features, or GPU architecture), and
``resolvedDependencies`` (the input model and each ``.rule`` file used, with their sha256);
``runDetails.builder``: :data:`BUILDER_ID` with the versions of cuvil and its tools.

Deterministic: no ``metadata`` start or finish times, no invocation id, no paths of the machine that built
it (docs/supply-chain.md says why), so that a rebuild is byte-identical and the statement of a cached build
is as true as that of a fresh one."""
from __future__ import annotations

import json
from typing import Any, Dict, Mapping

from .build_info import BuildInfo, jsonable

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
#: What kind of build this is: `cuvil compile` (CLI) or Pipeline.compile (Python), one build type.
BUILD_TYPE = "urn:cuvil:build-type:compile:v1"
#: Who built it: Cuvil itself, on the machine that ran it (a local build; no hosted build service).
BUILDER_ID = "urn:cuvil:builder:local:v1"


def provenance_statement(info: BuildInfo) -> Dict[str, Any]:
    deps = [{"name": info.model_name, "digest": {"sha256": info.model_sha256},
             "annotations": {"role": "model"}}]
    deps += [{"name": f.name, "digest": {"sha256": f.sha256}, "annotations": {"role": "rules"}}
             for f in sorted(info.rule_files, key=lambda f: f.name)]
    tools = {name: version for name, version in info.tools}
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": sha}} for name, sha in sorted(info.files.items())],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": jsonable({**info.parameters,
                                                "model": {"name": info.model_name, "sha256": info.model_sha256}}),
                "internalParameters": jsonable({"target": info.target,
                                                "rules_applied": info.rules,
                                                **({"model_graph_sha256": info.model_graph_sha256}
                                                   if info.model_graph_sha256 else {})}),
                "resolvedDependencies": deps,
            },
            "runDetails": {
                "builder": {"id": BUILDER_ID, "version": {"cuvil": info.compiler_version, **tools}},
                "metadata": {},
            },
        },
    }


def rename_in_provenance(path: str, renames: Mapping[str, str], digests: Mapping[str, str]) -> None:
    """Rewrite the statement at ``path`` for an artifact saved under other file names (``renames``: old ->
    new name); ``digests``: new name -> sha256 of the files whose bytes changed (the SBOM, which names them)."""
    with open(path, encoding="utf-8") as f:
        st = json.load(f)
    for s in st["subject"]:
        s["name"] = renames.get(s["name"], s["name"])
        if s["name"] in digests:
            s["digest"] = {"sha256": digests[s["name"]]}
    st["subject"] = sorted(st["subject"], key=lambda s: s["name"])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(st, f, sort_keys=True, indent=1)
        f.write("\n")


def write_provenance(path: str, info: BuildInfo) -> str:
    """Write ``info``'s provenance statement to ``path`` (``libNAME.intoto.json``); returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(provenance_statement(info), f, sort_keys=True, indent=1)
        f.write("\n")
    return path
