"""``cuvil verify-artifact ARTIFACT --key PUB.pem``: check an artifact's signature and every file it covers
(:mod:`cuvil.signing`). Exit 0 and one OK line when it holds, 1 and the reason when it does not."""
from __future__ import annotations

import sys

from ..signing import SignatureError, ok_line, verify_artifact
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("verify-artifact", help="check a signed artifact before shipping or loading it",
                        description="Check ARTIFACT (a libNAME.so with its sidecars, or a NAME.cuvil bundle) "
                                    "against its signature (libNAME.sig; NAME.cuvil/model.sig) with the signer's "
                                    "public key: the signature must be by that key, and every file it covers "
                                    "must be there, unaltered, with no unsigned file added. Exit 0 with one OK "
                                    "line naming the files covered; exit 1 with the reason (unsigned, another "
                                    "key, which file is altered, missing or extra). Example: cuvil "
                                    "verify-artifact build/libnet.so --key keys/pub.pem")
    sp.add_argument("artifact", metavar="ARTIFACT", help="a libNAME.so or a NAME.cuvil bundle directory")
    sp.add_argument("--key", required=True, metavar="PUB.pem", help="the signer's public key")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_verify_artifact)


def cmd_verify_artifact(args) -> int:
    try:
        v = verify_artifact(args.artifact, args.key)
    except SignatureError as e:
        print(f"cuvil: refused: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(ok_line(v))
    return 0
