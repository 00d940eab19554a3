"""The one error hierarchy of astrai.

Servers map these classes to status codes in one place; nothing matches
on message text.
"""

from __future__ import annotations


class AstraiError(Exception):
    """Base class of every error astrai raises on purpose."""


class PluginError(AstraiError):
    """A plugin failed to load, or does not implement the ABC of its group."""


class BackendUnavailable(AstraiError):
    """The selected attention backend cannot run this call (dtype, device, head dim, missing kernel)."""


class KernelUnavailable(BackendUnavailable):
    """A compiled kernel in ``astrai.extension.ops`` is not built or not loadable."""


class CapacityExceeded(AstraiError):
    """The KV pool (or request table) has no room for what was asked."""


class Overloaded(AstraiError):
    """The engine sheds load: its waiting queue is full, or a request waited longer than allowed.

    Nothing of the request was admitted or kept; the client may retry later (servers answer
    429, Anthropic's 529 ``overloaded_error``, with ``Retry-After``).
    """


class RequestRejected(AstraiError):
    """A request can never be served (too long for the context or the pool, bad parameters).

    ``param`` names the offending request field when one is to blame (servers put it in
    the protocol's error body).
    """

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AdapterError(AstraiError):
    """A LoRA adapter cannot be loaded (no such path, not a LoRA, a rank over the limit, made for
    another base model) or named (already in use); nothing of it is kept."""


class AdapterBusy(AstraiError):
    """No room for another LoRA adapter: every resident one has requests in flight."""


class ModelNotFound(AstraiError):
    """A model name or path could not be resolved, or its weights are missing."""


class ModelFormatError(AstraiError):
    """A model file is malformed: truncated, or its metadata contradicts its tensors or itself.

    Raised while the file's header is read, before anything of the model is allocated; the
    message names the file and the field (``block_count``, ``head_count``, a tensor).
    """


class InsufficientMemory(AstraiError):
    """A model (its weights, and the KV pool an engine would give it) needs more memory than is
    available; raised before anything is allocated, the message naming the numbers."""


class EngineNotReady(AstraiError):
    """The engine is not started yet, or its scheduler thread has died."""


class ChatTemplateError(AstraiError):
    """A chat template given by the user (``--chat-template``) is not there, cannot be read or does
    not compile; the message names the file (or ``inline``) and the line."""
