"""A model process of the router (:mod:`.workers`): ``python -m vmem.server.worker OPTIONS_JSON``
serves one model on the Unix socket its options name, as a tenant of the router's pool, and
stops when the router is gone."""

from __future__ import annotations

import logging
import os
import sys

from .options import ServerOptions
from .serve import PROG, serve_one
from .workers import watch_parent


def main() -> int:
    if len(sys.argv) != 2:
        print(f"usage: python -m vmem.server.worker OPTIONS_JSON (started by {PROG})", file=sys.stderr)
        return 2
    opts = ServerOptions.from_json(sys.argv[1])
    logging.basicConfig(level=opts.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [{opts.models[0].name}] %(name)s: %(message)s")
    watch_parent(os.getppid())
    return serve_one(opts, access_log=False)


if __name__ == "__main__":
    sys.exit(main())
