"""The sampling strategy ABC: one logits transformation, vectorised over a batch of rows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from astrai.sampling.params import SamplingBatch

__all__ = ["SamplingStrategy", "BaseSamplingStrategy"]


class SamplingStrategy(ABC):
    """One step of turning next-token logits into a distribution to sample from.

    Implementations are registered in the ``astrai.sampling`` entry-point group under
    :attr:`name`. The built-ins ``temperature``, ``top_k`` and ``top_p`` always run, in
    that order; any other strategy is an *extra* that a
    :class:`~astrai.sampling.pipeline.SamplingPipeline` runs after them, either on the
    rows whose ``SamplingParams.strategy`` names it or, when the configuration enables
    it, on every row. An extra is always called with the whole batch; the pipeline keeps
    its result only on the rows that selected it, so it must be row-local (row ``i`` of
    the result may depend on row ``i`` of ``logits`` and of ``batch`` only).

    Per-row parameters come from ``batch``: the built-in fields (``batch.temperature``,
    ``batch.top_k``, ...) or, for plugins, ``batch.extra_tensor(key, default)``, which
    reads ``SamplingParams.extra[key]`` of every row.
    """

    name: ClassVar[str]
    """Entry-point name; also the value of ``SamplingParams.strategy`` that selects it."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Transform the logits of every row of ``batch``.

        Args:
            logits: float32 ``[B, V]`` on ``batch.device``, already penalised and
                processed by the strategies before this one; ``-inf`` marks filtered
                tokens. The callee may modify it in place.
            batch: per-row parameters of the same ``B`` rows.

        Returns:
            float32 ``[B, V]`` on the same device (``logits`` itself or a new tensor).
            Filtered tokens are ``-inf``; a ``-inf`` input stays ``-inf`` and every row
            keeps at least one finite logit. Rows with ``temperature == 0`` are sampled
            greedily from the penalised logits before any strategy runs, so a strategy
            may leave them untouched.

        Must not synchronise the device unless unavoidable (document it if so), and
        must not loop over rows or tokens in Python. Raises
        :class:`~astrai.errors.RequestRejected` when a row's parameters are invalid.
        """


BaseSamplingStrategy = SamplingStrategy
"""The spec's name for :class:`SamplingStrategy`."""
