"""Graph rewriting: code passes (folding, DCE, CSE, shape propagation) and, later, the rule engine."""
from .passes import PassReport, run_code_passes

__all__ = ["PassReport", "run_code_passes"]
