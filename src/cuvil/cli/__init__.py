"""The ``cuvil`` command line: one module per subcommand, each with ``register(sub)`` (its parser) and its
``cmd_*`` function; shared flags in ``flags``/``shape_flags``. ``main`` prints a CuvilError as ``cuvil: error:``
and exits 2; a closed pipe (``cuvil ops | head``) ends it quietly."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import List, Optional

from ..errors import CuvilError
from ..version import __version__
from . import (bench, compile, demo, doctor, inspect, keygen, lora, ops, precision, rules, run, serve, sign, verify,
               verify_artifact, weights_key, zoo)

#: The subcommands, in the order ``cuvil --help`` lists them.
COMMANDS = (inspect, demo, zoo, rules, compile, precision, lora, run, serve, verify, ops, bench, doctor, weights_key,
            keygen, sign, verify_artifact)


class CuvilArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors (a missing MODEL, ``--threads abc``, an unknown flag) read like every
    other Cuvil error: the usage line, then ``cuvil: error: MESSAGE`` and the next step (this command's help).
    Subcommand parsers are made of this class too (argparse gives them the parent's class)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"cuvil: error: {self.prog}: {message}\n  next: {self.prog} --help lists its arguments\n")


def build_parser() -> argparse.ArgumentParser:
    p = CuvilArgumentParser(prog="cuvil", description="Compile ONNX inference graphs into native artifacts.")
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
        rc = args.fn(args)
        sys.stdout.flush()   # a reader that stopped early (cuvil ops | head) shows here, not at exit
        return rc
    except CuvilError as e:
        print(f"cuvil: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so that the interpreter's final flush does not
        # fail again, and exit as a process stopped by SIGPIPE does (128 + 13), quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        return 130
