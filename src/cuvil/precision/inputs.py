"""Input ranges: declared (``x=-3:3``, certified by the analysis that follows) or measured from calibration
data (``.npy`` files named after the inputs, or one ``.npz``; measured, not certified: they hold for the data
seen, and the report says so)."""
from __future__ import annotations

import glob
import os
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import CuvilError
from .interval import CERTIFIED, MEASURED, Interval

RangeSpec = Union[Tuple[float, float], Sequence[float]]


def parse_input_range(text: str) -> Tuple[str, Tuple[float, float]]:
    """``NAME=LO:HI`` (``x=-3:3``, ``x=0:1``, ``mask=-1e9:0``) as ``(name, (lo, hi))``."""
    name, sep, rest = text.partition("=")
    lo, sep2, hi = rest.partition(":")
    try:
        if not (name and sep and sep2):
            raise ValueError
        pair = (float(lo), float(hi))
    except ValueError:
        raise CuvilError(f"--input-range {text!r} is not NAME=LO:HI", hint="e.g. --input-range x=-3:3") from None
    if not pair[0] <= pair[1] or np.isnan(pair).any():
        raise CuvilError(f"--input-range {text!r}: LO must be <= HI", hint=f"--input-range {name}={hi}:{lo}")
    return name, pair


def declared_ranges(ranges: Optional[Mapping[str, RangeSpec]], input_names: Iterable[str]) -> Dict[str, Interval]:
    """``{"x": (lo, hi)}`` checked against the graph's inputs, as certified intervals."""
    names = list(input_names)
    out = {}
    for name, spec in (ranges or {}).items():
        if name not in names:
            raise CuvilError(f"input range for {name!r}, which is not an input of the model",
                             hint=f"the inputs are {', '.join(names)}")
        try:
            lo, hi = (float(v) for v in spec)
        except (TypeError, ValueError):
            raise CuvilError(f"input range of {name!r} must be (lo, hi), got {spec!r}",
                             hint=f'input_ranges={{"{name}": (-3.0, 3.0)}}') from None
        if not lo <= hi:
            raise CuvilError(f"input range of {name!r}: lo {lo} > hi {hi}", hint="give (lo, hi) with lo <= hi")
        # rounded outward to float32: ``x=-0.1:0.1`` holds np.float32(0.1), which is a little above 0.1
        with np.errstate(over="ignore"):
            lo, hi = min(lo, float(np.float32(lo))), max(hi, float(np.float32(hi)))
        out[name] = Interval.of(lo, hi, CERTIFIED)
    return out


def load_calibration(path: str, input_names: Iterable[str]) -> Dict[str, np.ndarray]:
    """The calibration arrays of ``path``: a directory of NAME.npy (one per input; a leading axis of samples is
    fine) or an .npz with one array per input name."""
    names = list(input_names)
    if os.path.isdir(path):
        files = {os.path.splitext(os.path.basename(f))[0]: f for f in glob.glob(os.path.join(path, "*.npy"))}
        data = {k: np.load(f) for k, f in files.items() if k in names}
        if not data:
            raise CuvilError(f"--calibrate {path}: no .npy file named after an input ({', '.join(names)})",
                             hint=f"save each input's samples as {os.path.join(path, names[0] if names else 'x')}.npy")
        return data
    if path.endswith(".npz") and os.path.isfile(path):
        with np.load(path) as z:
            data = {k: z[k] for k in z.files if k in names}
        if not data:
            raise CuvilError(f"--calibrate {path}: no array named after an input ({', '.join(names)})",
                             hint="np.savez(path, **{input_name: samples})")
        return data
    raise CuvilError(f"--calibrate {path}: not a directory of .npy files nor an .npz file",
                     hint="give a directory holding NAME.npy per input, or a .npz file")


def calibration_ranges(data: Mapping[str, np.ndarray]) -> Dict[str, Interval]:
    """Measured ranges: the hull of each input's calibration values (not certified)."""
    out = {}
    for name, arr in data.items():
        a = np.asarray(arr, dtype=np.float64)
        if a.dtype.kind != "f" and not np.issubdtype(a.dtype, np.number) or not a.size:
            continue
        out[name] = Interval.of(float(np.min(a)), float(np.max(a)), MEASURED,
                                f"{name}: measured on calibration data ({a.size} values), not certified")
    return out
