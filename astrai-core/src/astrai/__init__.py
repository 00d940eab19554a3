"""astrai: an LLM inference engine built as a layered plugin framework.

``astrai.hookimpl`` marks a hook plugin's implementations (see ``astrai.hookspecs``);
the entry-point groups are named in ``astrai.plugins``.
"""

from __future__ import annotations

from astrai.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
