"""Fuzzing Cuvil as a hostile user would: malformed ONNX, rule text and C ABI calls.

Each family is a module of this package with ``run(budget: int, seed: int) -> FamilyReport``
(:mod:`cuvil.fuzz.report`); ``python -m cuvil.fuzz --budget N`` runs them all.
"""
FAMILIES = ("onnx_bytes", "onnx_structure", "rule_text", "c_abi")
