"""SamplingPipeline: penalties -> temperature -> top-k -> top-p -> min-p -> extras -> draw.

Over 300 lines because the pipeline is one class: its plugin discovery, its per-request
validation at admission and its per-step application read best together.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from astrai.errors import PluginError, RequestRejected
from astrai.extension.fused import greedy_tokens, kernel_for
from astrai.plugins import load_plugins
from astrai.sampling.base import SAMPLING, SamplingStrategy, check_strategy_class
from astrai.sampling.batch import SamplingBatch
from astrai.sampling.min_p import MinPStrategy
from astrai.sampling.noise import categorical
from astrai.sampling.params import SamplingParams
from astrai.sampling.penalties import apply_penalties
from astrai.sampling.temperature import TemperatureStrategy
from astrai.sampling.top_k import TopKStrategy
from astrai.sampling.top_p import TopPStrategy

if TYPE_CHECKING:
    from astrai.plugins import LoadedPlugins, PluginFailure

__all__ = ["BUILTINS", "SamplingPipeline", "sample"]

logger = logging.getLogger(__name__)

BUILTINS: dict[str, type[SamplingStrategy]] = {
    "temperature": TemperatureStrategy,
    "top_k": TopKStrategy,
    "top_p": TopPStrategy,
    "min_p": MinPStrategy,
}
"""The stages every row goes through, in order, by entry-point name."""


class SamplingPipeline(SamplingStrategy):
    """Composes the strategies and draws one token per row.

    Order: penalties, logit bias and bans, then the stages (Temperature -> Top-K -> Top-P -> Min-P),
    then each extra strategy on the rows that select it (``SamplingParams.strategy``
    names it or ``SamplingParams.extra`` has its name as a key) or on every row when
    it is ``enabled``, then a draw from the softmax of the result. Temperature 0 rows
    take the argmax of the penalised logits instead.

    Args:
        stages: the strategies every row goes through; default the three built-ins.
        extra: plugin strategies, selectable per request by their ``name``.
        enabled: names of extras that run on every row.
        defaults: configured values of extra parameters (``{"min_p": 0.05}``), merged
            under every request's ``extra`` by :meth:`prepare`; a default for an
            extra's name thus selects it for every request that does not override it.
        failures: sampling plugins that failed to load, by name: selecting one (by
            ``strategy``, an ``extra`` key or a default) raises its error.

    Raises:
        PluginError: an extra is not a SamplingStrategy, two share a name, an enabled
            name is not among the extras, a default names no extra's parameter or a
            failed plugin, or a default's value is invalid.
    """

    name = "pipeline"

    def __init__(
        self,
        stages: Iterable[SamplingStrategy] | None = None,
        extra: Iterable[SamplingStrategy] = (),
        enabled: Iterable[str] = (),
        defaults: Mapping[str, Any] | None = None,
        failures: Mapping[str, PluginFailure] | None = None,
    ) -> None:
        self.stages = [cls() for cls in BUILTINS.values()] if stages is None else list(stages)
        self._builtin_stages = [type(stage) for stage in self.stages] == list(BUILTINS.values())
        self.extra: dict[str, SamplingStrategy] = {}
        for strategy in extra:
            if not isinstance(strategy, SamplingStrategy):
                raise PluginError(f"sampling strategy {strategy!r} is not a SamplingStrategy")
            name = getattr(strategy, "name", None)
            if not isinstance(name, str) or not name or name in self.extra or name in BUILTINS:
                raise PluginError(
                    f"sampling strategy {type(strategy).__name__} has a missing or duplicate name {name!r}"
                )
            self.extra[name] = strategy
        self.failures = dict(failures or {})
        self.enabled = tuple(enabled)
        for name in self.enabled:
            self._require(name, "sampling strategy")
        self.defaults = dict(defaults or {})
        for key in self.defaults:
            if key not in self.extra_keys:
                self._require(key, "sampling parameter")
        try:
            self.validate(SamplingParams(extra=self.defaults))
        except RequestRejected as err:
            raise PluginError(f"configured sampling defaults {self.defaults}: {err}") from err

    def _require(self, name: str, what: str) -> None:
        """Raise the failure of plugin ``name``, or PluginError when no extra is called ``name``."""
        if name in self.failures:
            raise self.failures[name].as_error() from self.failures[name].error
        if name not in self.extra:
            raise PluginError(
                f"{what} {name!r} not found; misspelled or not installed? "
                f"Installed: {', '.join([*BUILTINS, *self.extra]) or 'none'}"
            )

    @classmethod
    def default(cls, extra: Iterable[SamplingStrategy] = (), enabled: Iterable[str] = ()) -> SamplingPipeline:
        """The built-in stages plus the given extras."""
        return cls(None, extra, enabled)

    @classmethod
    def discover(cls, defaults: Mapping[str, Any] | None = None) -> SamplingPipeline:
        """The pipeline of every installed ``astrai.sampling`` strategy (see :meth:`from_strategies`).

        Plugins that failed to load are logged and kept as ``failures``; raises their
        error when ``defaults`` selects one.
        """
        loaded = load_sampling_strategies()
        for failure in loaded.failures.values():
            logger.warning("sampling strategy skipped: %s", failure.describe())
        return cls.from_strategies(loaded.classes, defaults=defaults, failures=loaded.failures)

    @classmethod
    def from_strategies(
        cls,
        strategies: Mapping[str, SamplingStrategy | type[SamplingStrategy]],
        enabled: Iterable[str] = (),
        defaults: Mapping[str, Any] | None = None,
        failures: Mapping[str, PluginFailure] | None = None,
    ) -> SamplingPipeline:
        """Build from the ``astrai.sampling`` entry points (name -> class or instance).

        The built-in names become the stages (their built-in classes when absent), every
        other entry an extra. Raises PluginError when an entry is not a SamplingStrategy or
        its ``name`` differs from its entry-point name.
        """
        found: dict[str, SamplingStrategy] = {}
        for ep_name, obj in strategies.items():
            strategy = obj() if isinstance(obj, type) and issubclass(obj, SamplingStrategy) else obj
            if not isinstance(strategy, SamplingStrategy):
                raise PluginError(
                    f"entry point {ep_name!r} in astrai.sampling is {obj!r}, not a SamplingStrategy"
                )
            if strategy.name != ep_name:
                raise PluginError(
                    f"entry point {ep_name!r} in astrai.sampling loads a strategy named {strategy.name!r}"
                )
            found[ep_name] = strategy
        stages = [found.pop(name, None) or builtin() for name, builtin in BUILTINS.items()]
        return cls(stages, found.values(), enabled, defaults, failures)

    @property
    def extra_keys(self) -> frozenset[str]:
        """Every name and ``extra_params`` key of the extras: what ``SamplingParams.extra`` may set."""
        return frozenset(key for s in self.extra.values() for key in (s.name, *s.extra_params))

    def _selected(self, name: str, params: SamplingParams) -> bool:
        return name in self.enabled or params.strategy == name or name in params.extra

    def prepare(self, params: SamplingParams, vocab_size: int | None = None) -> SamplingParams:
        """``params`` with the configured defaults merged under its ``extra``, validated; call at admission.

        A ``top_k`` at or above ``vocab_size`` keeps every token: it becomes 0 (off), as vLLM treats
        it, so no huge value reaches a tensor. Returns ``params`` when nothing changes; raises as
        :meth:`validate`."""
        missing = {k: v for k, v in self.defaults.items() if k not in params.extra}
        if missing:
            params = dataclasses.replace(params, extra={**missing, **params.extra})
        if vocab_size is not None and params.top_k >= vocab_size:
            params = dataclasses.replace(params, top_k=0)
        self.validate(params, vocab_size)
        return params

    def validate(self, params: SamplingParams, vocab_size: int | None = None) -> None:
        """Reject a request this pipeline cannot serve (call at admission, not per step).

        Raises RequestRejected for an unknown ``strategy``, a ``logit_bias`` or ``stop_token_ids``
        id outside ``[0, vocab_size)`` or an invalid parameter of an extra (``SamplingStrategy.validate``
        of each extra the request selects or sets one of the ``extra_params`` of: an extra reads every
        row's values once a row selects it); the plugin's PluginError when the request selects a
        sampling plugin that failed to load.
        """
        for name in (params.strategy, *params.extra):
            if name in self.failures:
                raise self.failures[name].as_error() from self.failures[name].error
        if (
            params.strategy is not None
            and params.strategy not in self.extra
            and params.strategy not in BUILTINS
        ):
            raise RequestRejected(
                f"sampling strategy {params.strategy!r} not found; available: "
                f"{', '.join([*BUILTINS, *self.extra])}"
            )
        for name, strategy in self.extra.items():
            if self._selected(name, params) or any(k in params.extra for k in strategy.extra_params):
                strategy.validate(params)
        if vocab_size is not None and any(t >= vocab_size for t in params.logit_bias):
            raise RequestRejected(
                f"logit_bias token ids must be < vocab size {vocab_size}", param="logit_bias"
            )
        if vocab_size is not None and any(t >= vocab_size for t in params.stop_token_ids):
            raise RequestRejected(f"stop_token_ids must be < vocab size {vocab_size}", param="stop_token_ids")

    def apply(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Penalties, stages and extras; float32 ``[B, V]`` with -inf for filtered tokens.

        Modifies ``logits`` in place when it is float32. Raises RequestRejected when a row
        selects a strategy this pipeline does not have.
        """
        logits = apply_penalties(self._check(logits, batch, copy=False), batch)
        return self._filter(logits, batch)

    @torch.no_grad()
    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The float32 ``[B, V]`` distribution :meth:`sample` draws from (greedy rows: one-hot).

        ``logits`` is not modified.
        """
        logits = apply_penalties(self._check(logits, batch, copy=True), batch)
        greedy_ids = logits.argmax(dim=-1) if batch.any_greedy else None
        probs = torch.softmax(self._filter(logits, batch), dim=-1)
        if greedy_ids is not None:
            one_hot = torch.zeros_like(probs).scatter_(1, greedy_ids.unsqueeze(1), 1.0)
            probs = torch.where(batch.greedy.unsqueeze(1), one_hot, probs)
        return probs

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Next token of every row: int64 ``[B]`` on ``logits.device``.

        Args:
            logits: ``[B, V]`` (any float dtype; computed in float32), on ``batch.device``.
                Not modified.
            batch: the step's rows.

        A seeded row's token depends only on its logits, parameters, seed and step, never
        on the other rows. Synchronises the device only when some top-p row needs a full
        sort (see :class:`TopPStrategy`). Raises RequestRejected for an unknown strategy.
        """
        if batch.all_greedy and not batch.changes_logits:
            return self._check(logits, batch, copy=False).argmax(dim=-1)
        draw = kernel_for("categorical", logits)
        if draw is not None and self._temperature_only(logits, batch):
            # Nothing but a temperature between the logits and the draw: the kernel divides as it
            # reads them, in place (no copy, no softmax tensor).
            self._check(logits, batch, copy=False)
            ids = draw(
                logits, batch.temperature if batch.needs_temperature else None, batch.seeds, batch.steps
            )
            return torch.where(batch.greedy, greedy_tokens(logits), ids) if batch.any_greedy else ids
        logits = apply_penalties(self._check(logits, batch, copy=True), batch)
        # Greedy rows read the penalised logits before any stage divides or filters them.
        greedy_ids = logits.argmax(dim=-1) if batch.any_greedy else None
        if batch.all_greedy:
            return greedy_ids
        filtered = self._filter(logits, batch)
        if draw is not None and filtered.dtype == torch.float32 and filtered.stride(-1) == 1:
            ids = draw(filtered, None, batch.seeds, batch.steps)
        else:
            ids = categorical(torch.softmax(filtered, dim=-1), batch.seeds, batch.steps)
        return ids if greedy_ids is None else torch.where(batch.greedy, greedy_ids, ids)

    def _temperature_only(self, logits: torch.Tensor, batch: SamplingBatch) -> bool:
        """The draw of ``batch`` is ``softmax(logits / temperature)``'s: float32 rows, the built-in stages
        with no row filtering, no penalty, bias or ban, no extra strategy that would run."""
        return (
            logits.dtype == torch.float32
            and logits.dim() == 2
            and logits.stride(-1) == 1
            and self._builtin_stages
            and not (batch.changes_logits or batch.max_top_k or batch.needs_top_p or batch.needs_min_p)
            and not any(
                name in self.enabled or any(self._selected(name, p) for p in batch.params)
                for name in self.extra
            )
        )

    def _check(self, logits: torch.Tensor, batch: SamplingBatch, copy: bool) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"logits of shape {tuple(logits.shape)} for a batch of {batch.size} rows")
        unknown = {s for s in batch.strategies if s is not None} - self.extra.keys() - BUILTINS.keys()
        if unknown:
            raise RequestRejected(
                f"sampling strategy {sorted(unknown)} not found; available: "
                f"{', '.join([*BUILTINS, *self.extra])}"
            )
        return logits.to(torch.float32, copy=copy)  # one copy at most, also from bf16/fp16

    def _filter(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        for stage in self.stages:
            logits = stage.apply(logits, batch)
        for name, strategy in self.extra.items():
            rows = [self._selected(name, p) for p in batch.params]  # host side: no tensor per row
            if name in self.enabled or all(rows):
                logits = strategy.apply(logits, batch)
            elif any(rows):
                # Run on a copy and keep its rows only: the others stay bit-identical.
                mask = torch.tensor(rows, device=logits.device).unsqueeze(1)
                logits = torch.where(mask, strategy.apply(logits.clone(), batch), logits)
        return logits


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
) -> torch.Tensor:
    """One-shot sampling of ``[B, V]`` (-> int64 ``[B]``) or ``[V]`` logits (-> int64 scalar).

    Every row uses the same parameters. With a seed, row ``i`` uses noise counter ``i``,
    so rows of one call differ and a repeated call returns the same tokens. Raises
    RequestRejected for out-of-range parameters.
    """
    rows = logits.unsqueeze(0) if logits.dim() == 1 else logits
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    n = rows.shape[0]
    batch = SamplingBatch.from_params([params] * n, range(n), rows.device)
    ids = SamplingPipeline.default().sample(rows, batch)
    return ids[0] if logits.dim() == 1 else ids


def load_sampling_strategies() -> LoadedPlugins:
    """Every installed ``astrai.sampling`` strategy class, built-ins included (validated; failures kept)."""
    return load_plugins(SAMPLING, check_strategy_class)
