"""Code generation targets, one folder each, found through :data:`TARGETS`.

Adding a backend is one folder plus one row: ``cuvil/targets/NAME/target.py`` defines ``TARGET`` (see
:class:`cuvil.targets.base.Target`: ``plan``, ``emit``, ``load``) and its option class, and :data:`TARGETS`
maps the target triple to that module. :meth:`cuvil.Pipeline.compile` and ``cuvil compile`` look targets up
here and nowhere else. The table names modules (strings), so this package needs neither backend to be
imported; :mod:`cuvil.artifact` imports both, since `cuvil.load` opens either kind of artifact.
"""
from __future__ import annotations

import importlib
from typing import Dict

from ..errors import CuvilError
from .base import Target, TargetOptions

X86_TARGET = "x86_64-linux-gnu"
PTX_TARGET = "nvptx64-nvidia-cuda"

#: target triple -> the module defining its ``TARGET``
TARGETS: Dict[str, str] = {
    X86_TARGET: "cuvil.targets.x86.target",
    PTX_TARGET: "cuvil.targets.ptx.target",
}


def get_target(triple: str) -> Target:
    """The target of ``triple``; an unknown triple is a :class:`CuvilError` listing the table."""
    module = TARGETS.get(triple)
    if module is None:
        raise CuvilError(f"unknown target {triple!r}; the targets are "
                         + ", ".join(f"{t} ({m})" for t, m in TARGETS.items()))
    return importlib.import_module(module).TARGET


def make_options(triple: str, **options) -> TargetOptions:
    """Target ``triple``'s option object from keywords; a keyword that belongs to another target is a
    :class:`CuvilError` saying which."""
    cls = get_target(triple).options_type
    for key in sorted(set(options) - set(cls.names())):
        owners = [t for t in TARGETS if t != triple and key in get_target(t).options_type.names()]
        if owners:
            raise CuvilError(f"{key} is an option of the {' and '.join(owners)} target only, not of {triple} "
                             f"(its options: {', '.join(cls.names())})")
    return cls(**options)


__all__ = ["TARGETS", "X86_TARGET", "PTX_TARGET", "Target", "TargetOptions", "get_target", "make_options"]
