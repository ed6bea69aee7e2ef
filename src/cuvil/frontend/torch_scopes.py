"""The torch module a node of an exported graph came from, as the torch exporters record it: the dynamo
exporter's ``pkg.torch.onnx.name_scopes`` metadata (its innermost module scope), or the TorchScript exporter's
node path (``/model/encoder/layer.0/attention/self/query/MatMul`` -> ``model.encoder.layer.0.attention.self.query``).

The importer keeps it on each IR node (``Node.scope``) and LoRA's mapping reads it from the ONNX nodes: both
name linear layers by module (``encoder.layer.0.attention.self.query``) when the exporter lost the weights'
names (``val_49``, ``onnx::MatMul_335``).
"""
from __future__ import annotations

import ast
from typing import Optional

import onnx


def node_scope(node: onnx.NodeProto) -> Optional[str]:
    """The torch module path a node came from, as the exporters record it, or None."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                continue
            scope = ""
            for s in scopes:
                if isinstance(s, str) and s and (not scope or s.startswith(scope + ".")):
                    scope = s
            if scope:
                return scope
    if node.name.startswith("/") and node.name.count("/") >= 2:
        return ".".join(node.name.strip("/").split("/")[:-1])
    return None
