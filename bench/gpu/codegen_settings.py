"""Code generator settings for GPU benchmarks: ``KEY:VALUE`` pairs from the command line become keyword
arguments of :func:`cuvil.targets.ptx.bundle.compile_bundle` (``unpadded``, ``fused_splitk``; every other key
a field of :class:`cuvil.targets.ptx.tuning.PtxTuning`, e.g. ``target_blocks``, ``conv_enabled``,
``split_mode``). Nothing is set on a module: each build gets its own options."""
from __future__ import annotations

from typing import Dict

import attrs

from cuvil.targets.ptx.tuning import PtxTuning

BUNDLE_SWITCHES = ("unpadded", "fused_splitk")   # compile_bundle's own keywords; the rest go into PtxTuning
_TUNING_FIELDS = {f.name: f for f in attrs.fields(PtxTuning)}


def setting_names() -> list:
    return list(BUNDLE_SWITCHES) + list(_TUNING_FIELDS)


def parse_value(key: str, text: str):
    """``text`` as the type of setting ``key`` (bools as 0/1)."""
    if key in BUNDLE_SWITCHES:
        return bool(int(text))
    if key not in _TUNING_FIELDS:
        raise SystemExit(f"no setting {key!r}; settings: {', '.join(setting_names())}")
    default = _TUNING_FIELDS[key].default
    if isinstance(default, bool):
        return text.lower() in ("1", "true") if text.lower() in ("0", "1", "true", "false") else bool(int(text))
    return type(default)(text)


def parse_settings(body: str) -> Dict[str, object]:
    """``KEY:VALUE;KEY:VALUE`` -> {KEY: typed value}."""
    out = {}
    for kv in filter(None, body.split(";")):
        k, _, v = kv.partition(":")
        out[k] = parse_value(k, v)
    return out


def parse_assignments(text: str) -> Dict[str, object]:
    """``KEY=VALUE,KEY=VALUE`` (the benches' ``--variants``; ``default``: none) -> {KEY: typed value}."""
    if text == "default":
        return {}
    out = {}
    for kv in filter(None, text.split(",")):
        k, _, v = kv.partition("=")
        out[k] = parse_value(k, v)
    return out


def bundle_options(settings: Dict[str, object]) -> dict:
    """compile_bundle keywords for ``settings`` (as :func:`parse_settings` returns them)."""
    opts = {k: v for k, v in settings.items() if k in BUNDLE_SWITCHES}
    opts["tuning"] = PtxTuning(**{k: v for k, v in settings.items() if k not in BUNDLE_SWITCHES})
    return opts
