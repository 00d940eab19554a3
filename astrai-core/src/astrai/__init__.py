"""astrai: an LLM inference engine built as a layered plugin framework."""

from __future__ import annotations

__version__ = "0.1.0"
