"""``astrai serve``'s speculative settings: bad values stop it at start (the counters in /stats and
/metrics are tested on tests/server/test_metrics.py's server, which runs with ``--speculative ngram``)."""

from __future__ import annotations

from typing import Any

import pytest

from astrai_server.cli import serve_main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--ngram-min", "4", "--ngram-max", "3"],
            "--ngram-max: Value error, ngram_max must be >= ngram_min (4)",
        ),
        (
            ["--num-speculative-tokens", "0"],
            "--num-speculative-tokens: Input should be greater than or equal to 1",
        ),
        (
            ["--num-speculative-tokens", "16"],
            "--num-speculative-tokens: Input should be less than or equal to 15",
        ),
    ],
)
def test_a_bad_speculative_value_stops_serve_with_status_2(
    flags: list[str], message: str, capsys: Any
) -> None:
    assert serve_main(flags) == 2
    assert message in capsys.readouterr().err
