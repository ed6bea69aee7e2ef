"""Graph rewriting: the rule engine and the code passes that run in its loop (folding, CSE, DCE, shape
propagation), and the prover that discharges each rule's obligation."""
from .engine import NonTerminationError, RewriteReport, rewrite

__all__ = ["NonTerminationError", "RewriteReport", "rewrite"]
