"""Low precision with certificates (issue 21): range analysis, the precision policy and its report.

* :mod:`.interval`: the abstract values (an interval per tensor, per channel where that is tighter);
* :mod:`.ranges`: interval rules per op, propagated through a graph; :mod:`.affine`: correlated subtractions;
* :mod:`.inputs`: input ranges declared (``x=-3:3``) or measured from calibration data;
* :mod:`.formats`: what each number format (bf16, fp16, int8) can hold, with the margins the policy keeps;
* :mod:`.search`: the search of the declared input box for an input that overflows (a counterexample);
* :mod:`.policy`: which node computes in which format, and why the others stay float32;
* :mod:`.report`: the per-node report and the overflow-paths table of ``cuvil precision report``.

Layered below the targets (which say which ops they run narrowed, ``Target.precision_ops``) and above the IR.
"""
from .formats import FORMATS, PRECISIONS
from .inputs import calibration_ranges, parse_input_range
from .interval import Interval
from .policy import PrecisionPlan, apply_precision, plan_precision
from .ranges import analyze

__all__ = ["FORMATS", "PRECISIONS", "Interval", "analyze", "parse_input_range", "calibration_ranges",
           "PrecisionPlan", "plan_precision", "apply_precision"]
