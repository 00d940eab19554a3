"""The sampling strategy ABC: one logits transformation, vectorised over a batch of rows."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from astrai.errors import RequestRejected
from astrai.plugins import check_class
from astrai.sampling.params import brief_repr, finite

if TYPE_CHECKING:
    import torch

    from astrai.sampling.batch import SamplingBatch
    from astrai.sampling.params import SamplingParams

__all__ = ["SAMPLING", "BaseSamplingStrategy", "SamplingStrategy", "check_strategy_class"]

SAMPLING = "astrai.sampling"
"""The entry-point group of ``SamplingStrategy`` subclasses; the name selects one per request."""


class SamplingStrategy(ABC):
    """One step of turning next-token logits into a distribution to sample from.

    Implementations are registered in the ``astrai.sampling`` entry-point group under
    :attr:`name`. The built-ins ``temperature``, ``top_k`` and ``top_p`` always run, in
    that order; any other strategy is an *extra* that a
    :class:`~astrai.sampling.pipeline.SamplingPipeline` runs after them on the rows that
    select it: ``SamplingParams.strategy`` names it, or ``SamplingParams.extra`` has a key
    equal to its name (an HTTP request's ``"min_p": 0.1`` lands there), or the
    configuration enables it for every row. An extra is always called with the whole
    batch; the pipeline keeps its result only on the rows that selected it, so it must
    be row-local (row ``i`` of the result may depend on row ``i`` of ``logits`` and of
    ``batch`` only).

    Per-row parameters come from ``batch``: the built-in fields (``batch.temperature``,
    ``batch.top_k``, ...) or, for plugins, ``batch.extra_tensor(key, default)``, which
    reads ``SamplingParams.extra[key]`` of every row. Declare those keys in
    :attr:`extra_params`; :meth:`validate` checks them when a request is admitted.
    """

    name: ClassVar[str]
    """Entry-point name; also the value of ``SamplingParams.strategy`` that selects it."""

    extra_params: ClassVar[tuple[str, ...]] = ()
    """Keys of ``SamplingParams.extra`` this strategy reads (by convention the first is
    :attr:`name`); configuration may give them defaults (``--sampling min_p=0.05``)."""

    def validate(self, params: SamplingParams) -> None:
        """Check this strategy's parameters of one request that selected it, at admission.

        Called on the submitting thread, never per step, so that a bad value is the
        request's own 400 rather than a failed step. Also called for a request that sets one
        of :attr:`extra_params` without selecting this strategy (``apply`` reads every row's
        value whenever some row selected it). The default requires every key of
        :attr:`extra_params` present in ``params.extra`` to be a finite number that a float32
        tensor holds (``astrai.sampling.params.finite``); an override should call it and then
        check its own range. Raises :class:`~astrai.errors.RequestRejected` naming the parameter.
        """
        for key in self.extra_params:
            value = params.extra.get(key, 0.0)
            if not finite(value):
                raise RequestRejected(f"{key} must be a finite number, got {brief_repr(value)}", param=key)

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


def check_strategy_class(name: str, plugin: object, origin: str) -> type[SamplingStrategy]:
    """Validate an ``astrai.sampling`` plugin: a ``SamplingStrategy`` named ``name``. Raises PluginError."""
    return check_class(SamplingStrategy, name, plugin, origin)
