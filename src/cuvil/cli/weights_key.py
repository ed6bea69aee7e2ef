"""``cuvil weights-key KEYFILE``: a fresh random key for ``cuvil compile --encrypt-weights KEYFILE``."""
from __future__ import annotations

from ..targets.x86.weights_file import new_key_file
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("weights-key", help="make a key file for --encrypt-weights (32 random bytes, as hex)",
                        description="Write a fresh random AES-256 key to KEYFILE (64 hex characters, readable by "
                                    "its owner only; an existing file is never overwritten), for cuvil compile "
                                    "--encrypt-weights KEYFILE and cuvil.load(path, weights_key=KEYFILE). Keep it "
                                    "apart from the artifact. Example: cuvil weights-key secrets/model.key")
    sp.add_argument("keyfile", metavar="KEYFILE", help="the key file to create")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_weights_key)


def cmd_weights_key(args) -> int:
    new_key_file(args.keyfile)
    if not args.quiet:
        print(f"wrote {args.keyfile} (a 256-bit key; give it to cuvil compile --encrypt-weights {args.keyfile})")
    return 0
