"""The model platform's errors: each carries its HTTP status and OpenAI error shape, and the
CLI prints its message as one line (exit code 2)."""

from __future__ import annotations

from collections.abc import Iterable

from ferrum.errors import FerrumError, InvalidRequest, NotFound


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, name: str, available: Iterable[str] = (), *, what: str = "model"):
        names = sorted(available)
        listed = ", ".join(repr(n) for n in names) if names else "none"
        super().__init__(f"{what} {name!r} not found; available: {listed}", param="model")
        self.available = names


class NotOnHub(NotFound):
    """The hub has no such repository or file, or the repository holds no GGUF model."""

    code = "model_not_found"


class HubAccessDenied(FerrumError):
    """A gated or private repository, and no token (or one without access) was given."""

    status = 403
    type = "invalid_request_error"
    code = "hub_access_denied"


class InvalidModelFile(InvalidRequest):
    """Not a GGUF, a GGUF version llama.cpp cannot read, or a truncated file."""

    code = "invalid_model_file"


class PullError(FerrumError):
    """The hub could not be reached or a download failed half-way."""

    status = 502
    type = "server_error"
    code = "pull_failed"


class InsufficientStorage(FerrumError):
    """The disk is full (ENOSPC): the partial files are removed."""

    status = 507
    type = "server_error"
    code = "insufficient_storage"


class InsufficientMemory(FerrumError):
    """A model that does not fit the memory budget even with every other model unloaded."""

    status = 507
    type = "server_error"
    code = "insufficient_memory"


class ModelBusy(FerrumError):
    """Another pull of the same model is running, or the model is being deleted."""

    status = 409
    type = "invalid_request_error"
    code = "model_busy"
