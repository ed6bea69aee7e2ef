"""``cuvil keygen --private KEY.pem --public PUB.pem``: a key pair to sign artifacts with (:mod:`cuvil.signing`)."""
from __future__ import annotations

from ..signing import keygen
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("keygen", help="make a key pair to sign artifacts with (EC P-256, PEM)",
                        description="Write a new EC P-256 key pair as PEM files, the keys model-signing signs "
                                    "and verifies with: the private key (mode 0600; keep it with whoever signs) and "
                                    "the public key (ship it to whoever verifies). Existing files are kept unless "
                                    "--force. Example: cuvil keygen --private keys/key.pem --public keys/pub.pem, "
                                    "then cuvil sign build/libnet.so --key keys/key.pem")
    sp.add_argument("--private", required=True, metavar="KEY.pem", help="the private key file to write")
    sp.add_argument("--public", required=True, metavar="PUB.pem", help="the public key file to write")
    sp.add_argument("--force", action="store_true", help="replace existing key files")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_keygen)


def cmd_keygen(args) -> int:
    keygen(args.private, args.public, force=args.force)
    if not args.quiet:
        print(f"wrote {args.private} (private, mode 0600) and {args.public} (public)")
    return 0
