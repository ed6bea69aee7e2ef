"""Supply-chain records of a compiled artifact (issue 24, docs/supply-chain.md): the SBOM
(:mod:`.sbom`, CycloneDX 1.6) and the build provenance (:mod:`.provenance`, an in-toto Statement v1 with a
SLSA v1 provenance predicate), both written at every compile from one :class:`.build_info.BuildInfo`, and
deterministic, so that a rebuild of the same model with the same options and compiler is byte-identical."""
from .build_info import BuildInfo, RuleFile
from .digests import sha256_file
from .provenance import BUILD_TYPE, BUILDER_ID, provenance_statement, write_provenance
from .record import record_build, rename_records
from .sbom import sbom_json, write_sbom

__all__ = ["BuildInfo", "RuleFile", "sha256_file", "BUILD_TYPE", "BUILDER_ID", "provenance_statement",
           "write_provenance", "sbom_json", "write_sbom", "record_build", "rename_records"]
