"""min-p sampling for astrai, registered as entry point ``min_p`` in ``astrai.sampling``.

A row keeps the tokens whose probability is at least ``min_p`` times that of its most
likely token. A request selects it by setting ``min_p`` (``SamplingParams.extra``);
configuration (``--sampling min_p=0.05``) sets it for every request.
"""

from __future__ import annotations

import torch

from astrai.errors import RequestRejected
from astrai.sampling import SamplingBatch, SamplingParams, SamplingStrategy

__all__ = ["MinPStrategy"]


class MinPStrategy(SamplingStrategy):
    """``p[i] < min_p * max(p)`` -> ``-inf``, per row; ``min_p`` 0 keeps the row whole.

    Since ``p[i] / max(p) = exp(logit[i] - max(logit))``, the test runs on logits:
    ``logit[i] < max(logit) + log(min_p)``, with no softmax. Ties with the top token
    are kept, so every row keeps at least one finite logit. In place; vectorised over
    rows; no device synchronisation.
    """

    name = "min_p"
    extra_params = ("min_p",)

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)  # a finite number
        value = params.extra.get("min_p", 0.0)
        if not 0.0 <= value <= 1.0:
            raise RequestRejected(f"min_p must be in [0, 1], got {value!r}")

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        min_p = batch.extra_tensor("min_p", 0.0)  # [B] f32; log(0) = -inf filters nothing
        floor = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [B, 1]
        return logits.masked_fill_(logits < floor, float("-inf"))
