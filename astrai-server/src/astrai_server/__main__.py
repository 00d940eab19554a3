"""``python -m astrai_server``: run ``astrai serve`` without the ``astrai`` command."""

from __future__ import annotations

import sys

from astrai_server.cli import serve_main

if __name__ == "__main__":
    sys.exit(serve_main())
