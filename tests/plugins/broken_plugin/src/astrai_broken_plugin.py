"""Plugins that import but are not what their group wants."""

from __future__ import annotations


class NotAStrategy:
    """In astrai.sampling, but no SamplingStrategy subclass."""

    name = "not_a_strategy"


NOT_AN_ARCHITECTURE = {"name": "broken_arch"}  # in astrai.models, but no Architecture


def astrai_request_finsihed(engine, request):  # noqa: ANN001 - the typo is the point: an unknown hook
    raise AssertionError("never called: the plugin is refused when it loads")
