"""The ``cuvil`` command line: one module per subcommand, each with ``register(sub)`` (its parser) and its
``cmd_*`` function; shared flags in ``flags``/``shape_flags``. ``main`` prints a CuvilError as ``cuvil: error:``
and exits 2."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..errors import CuvilError
from ..version import __version__
from . import bench, compile, demo, inspect, ops, rules, run, verify, zoo

#: The subcommands, in the order ``cuvil --help`` lists them.
COMMANDS = (inspect, demo, zoo, rules, compile, run, verify, ops, bench)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cuvil", description="Compile ONNX inference graphs into native artifacts.")
    p.add_argument("--version", action="version", version=f"cuvil {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except CuvilError as e:
        print(f"cuvil: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
