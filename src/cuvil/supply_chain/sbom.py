"""The SBOM of a compiled artifact: a CycloneDX 1.6 JSON document made with ``cyclonedx-python-lib``.

Its subject (``metadata.component``) is the artifact (``libNAME.so``, or the bundle ``NAME.cuvil``), with
each of its files as a sub-component with its SHA-256, and the target it was built for as properties
(``cuvil:target:*``: the triple, the CPU and ``cuvil:target:isa_features``, the ISA features the code needs;
or the GPU architecture). The components: the input model (type ``machine-learning-model``, the SHA-256 of
the ONNX bytes given), the compiler (``cuvil`` and its version) and each Python package and external tool
of the build with its version (``cc``, ``ptxas``), and the rules that rewrote the graph (type ``data``, one
per rule, with their proof verdicts as ``cuvil:rule:*`` properties and the SHA-256 of their ``.rule`` file).

Deterministic: no ``metadata.timestamp`` and a ``serialNumber`` derived from the document's content (a
UUID made from its SHA-256), so that rebuilding the same model writes the same bytes."""
from __future__ import annotations

import hashlib
import json
import uuid
from typing import Mapping

from .build_info import BuildInfo, jsonable, package_versions

#: The namespace of the serial numbers: UUID(sha256(content)) in it names one SBOM content.
_SERIAL_NAMESPACE = uuid.UUID("5c0b1b9e-3a3c-4d39-9d1f-6f1c8c1b2a24")


def _sha256(hexdigest: str):
    from cyclonedx.model import HashAlgorithm, HashType
    return HashType(alg=HashAlgorithm.SHA_256, content=hexdigest)


def _props(prefix: str, items) -> list:
    from cyclonedx.model import Property
    return [Property(name=f"{prefix}{k}", value=v if isinstance(v, str) else json.dumps(jsonable(v), sort_keys=True))
            for k, v in items if v is not None]


def _rule_components(info: BuildInfo) -> list:
    from cyclonedx.model.component import Component, ComponentType
    files = {f.name: f.sha256 for f in info.rule_files}
    out = []
    for name in sorted(info.rules):
        rec = dict(info.rules[name])
        src = rec.pop("file", None)
        out.append(Component(
            type=ComponentType.DATA, name=name, bom_ref=f"rule:{name}", group="cuvil-rules",
            description="a rewrite rule that rewrote the graph, with its proof verdict",
            hashes=[_sha256(files[src])] if src in files else None,
            properties=_props("cuvil:rule:", [("verdict", rec.pop("verdict", None)),
                                               ("obligation", rec.pop("obligation", None)),
                                               ("applied", str(rec.pop("applied", ""))), ("file", src)]
                              + sorted(rec.items()))))
    return out


def sbom_json(info: BuildInfo) -> str:
    """The CycloneDX 1.6 JSON text of ``info``'s SBOM (deterministic: see the module docstring)."""
    # imported here: the library takes a second to import, which `import cuvil` need not pay
    from cyclonedx.model.bom import Bom, BomMetaData
    from cyclonedx.model.component import Component, ComponentType
    from cyclonedx.model.dependency import Dependency
    from cyclonedx.output.json import JsonV1Dot6
    from packageurl import PackageURL
    target = info.target
    subject = Component(
        type=ComponentType.LIBRARY, name=info.artifact, bom_ref="artifact",
        description=f"{info.model_name} compiled by cuvil {info.compiler_version} for {target.get('triple')}",
        components=[Component(type=ComponentType.FILE, name=name, bom_ref=f"file:{name}", hashes=[_sha256(sha)])
                    for name, sha in sorted(info.files.items())],
        properties=_props("cuvil:target:", sorted(target.items())))
    model = Component(type=ComponentType.MACHINE_LEARNING_MODEL, name=info.model_name, bom_ref="model",
                      hashes=[_sha256(info.model_sha256)],
                      properties=_props("cuvil:model:", [("graph_sha256", info.model_graph_sha256)]))
    cuvil = Component(type=ComponentType.APPLICATION, name="cuvil", version=info.compiler_version, bom_ref="cuvil",
                      purl=PackageURL(type="pypi", name="cuvil", version=info.compiler_version),
                      description="the compiler that built the artifact")
    packages = [Component(type=ComponentType.LIBRARY, name=name, version=version, bom_ref=f"pypi:{name}",
                          purl=PackageURL(type="pypi", name=name.lower(), version=version))
                for name, version in package_versions()]
    tools = [Component(type=ComponentType.APPLICATION, name=name, version=version, bom_ref=f"tool:{name}")
             for name, version in info.tools]
    rules = _rule_components(info)
    deps = [Dependency(ref=subject.bom_ref, dependencies=[Dependency(ref=c.bom_ref) for c in [model, cuvil] + rules]),
            Dependency(ref=cuvil.bom_ref, dependencies=[Dependency(ref=c.bom_ref) for c in packages + tools])]
    bom = Bom(components=[model, cuvil, *packages, *tools, *rules], metadata=BomMetaData(component=subject),
              dependencies=deps)
    data = json.loads(JsonV1Dot6(bom).output_as_string())
    data.get("metadata", {}).pop("timestamp", None)   # a build time would make two equal builds differ
    return sbom_text(data)


def sbom_text(data: dict) -> str:
    """The SBOM ``data`` as written: its serial number derived from the rest of its content, sorted keys."""
    data = dict(data)
    data.pop("serialNumber", None)
    body = json.dumps(data, sort_keys=True, indent=1)
    data["serialNumber"] = uuid.uuid5(_SERIAL_NAMESPACE, hashlib.sha256(body.encode()).hexdigest()).urn
    return json.dumps(data, sort_keys=True, indent=1) + "\n"


def write_sbom(path: str, info: BuildInfo) -> str:
    """Write ``info``'s SBOM to ``path`` (``libNAME.cdx.json``); returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(sbom_json(info))
    return path


def rename_in_sbom(path: str, renames: Mapping[str, str]) -> None:
    """Rewrite the SBOM at ``path`` for an artifact saved under other file names (``renames``: old -> new
    name): the subject's name and its files' names (their hashes are the same bytes)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    subject = data.get("metadata", {}).get("component", {})
    subject["name"] = renames.get(subject.get("name"), subject.get("name"))
    for c in subject.get("components", []):
        if c.get("name") in renames:
            c["name"] = renames[c["name"]]
            c["bom-ref"] = f"file:{c['name']}"
    subject["components"] = sorted(subject.get("components", []), key=lambda c: c.get("name", ""))
    with open(path, "w", encoding="utf-8") as f:
        f.write(sbom_text(data))
