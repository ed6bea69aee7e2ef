"""Libraries compiled afresh for a test (never from the artifact cache, so they come from the current
sources), loaded, and removed afterwards."""
from __future__ import annotations

import os
import shutil

from ..artifact import load
from ..pipeline import Pipeline


def compile_and_load(model, profiles, **kw):
    """Compile uncached with ``shape_profiles=profiles`` and load the library; returns (Artifact, Model)."""
    art = Pipeline.from_onnx(model).compile(shape_profiles=profiles, cache=False, **kw)
    return art, load(art.path)


def close_and_remove(art, model) -> None:
    """Close the loaded library and delete the directory it was compiled into."""
    model.close()
    shutil.rmtree(os.path.dirname(art.path), ignore_errors=True)
