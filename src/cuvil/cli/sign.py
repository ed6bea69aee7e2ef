"""``cuvil sign ARTIFACT --key KEY.pem``: sign every file of a compiled artifact (:mod:`cuvil.signing`)."""
from __future__ import annotations

import os

from ..signing import artifact_files, sign
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("sign", help="sign a compiled artifact (libNAME.so and its sidecars, or a NAME.cuvil bundle)",
                        description="Sign ARTIFACT with an EC private key, in the OpenSSF model-signing format: the "
                                    "signature covers the SHA-256 of every file of the artifact (the library, its "
                                    "header, manifest and other sidecars; every file of a GPU bundle) and is "
                                    "written to libNAME.sig beside the library (NAME.cuvil/model.sig in a bundle). "
                                    "Sign after the artifact is complete: a file added or changed later is refused "
                                    "by verification. Example: cuvil sign build/libnet.so --key keys/key.pem")
    sp.add_argument("artifact", metavar="ARTIFACT", help="a libNAME.so or a NAME.cuvil bundle directory")
    sp.add_argument("--key", required=True, metavar="KEY.pem", help="the private key (cuvil keygen writes one)")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_sign)


def cmd_sign(args) -> int:
    files = sorted(artifact_files(args.artifact))
    sig = sign(args.artifact, args.key)
    if not args.quiet:
        print(f"signed {len(files)} files ({', '.join(files)}): {sig}")
        print(f"next: ship {os.path.basename(sig)} with the artifact; verify with cuvil verify-artifact "
              f"{args.artifact} --key PUB.pem")
    return 0
