"""``logjam-relay keygen DIR NAME``: a ZeroMQ CURVE key pair for the relay or a client.

Writes ``DIR/NAME.key`` (the public key: copy it into the peers' ``curve_allow_dir``, or
give it to clients as the server key) and ``DIR/NAME.key_secret`` (mode 0600: the relay's
``curve_secret_key``, or the client's own secret key), in the ZPL format of
``zmq.auth.create_certificates``.  The secret key is never printed.  An existing pair of
that name is never overwritten without ``--force``.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="logjam-relay keygen",
                                description="generate a ZeroMQ CURVE key pair "
                                            "(NAME.key public, NAME.key_secret 0600)")
    p.add_argument("directory")
    p.add_argument("name", help="file name stem, e.g. relay or agent-web1")
    p.add_argument("--force", action="store_true",
                   help="replace an existing key pair of that name")
    a = p.parse_args(argv)
    from ..io.curve import keygen, load_secret_key
    try:
        pub, sec = keygen(a.directory, a.name, force=a.force)
    except FileExistsError as e:
        print(f"logjam-relay keygen: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"logjam-relay keygen: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"logjam-relay keygen: {a.directory}: {e.strerror}", file=sys.stderr)
        return 2
    print(f"public key {load_secret_key(sec)[0].decode()}: {pub}")
    print(f"secret key (keep private, mode 0600): {sec}")
    return 0
