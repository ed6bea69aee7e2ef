"""Cuvil's graph IR: dtypes, symbolic dims, tensor types, values/nodes/graphs, the op registry."""
from .dim import Dim, Symbol, SymExpr, as_dim, parse_dim
from .dtype import DType
from .graph import Graph, GraphError, Node, Value
from .registry import CANON_OPSET, OpDef, all_ops, infer_node, lookup
from .types import TensorType

__all__ = ["Dim", "Symbol", "SymExpr", "as_dim", "parse_dim", "DType", "Graph", "GraphError", "Node", "Value",
           "CANON_OPSET", "OpDef", "all_ops", "infer_node", "lookup", "TensorType"]
