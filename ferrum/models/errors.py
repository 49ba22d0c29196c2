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


class StoreQuotaExceeded(InvalidRequest):
    """A pull or copy that would take the store past `--models-max-bytes`. A 400, not a 507:
    the disk is not full, the operator's limit refuses this request (as it would any other
    too large), and clients that retry 5xx answers must not retry it; every Ollama client
    shows the `{"error"}` message."""

    code = "store_quota_exceeded"


class PullCancelled(FerrumError):
    """The pull's client hung up (or the server is stopping): the download stops at its next
    chunk. Nobody reads this error."""

    status = 499  # "client closed request", as nginx counts it
    type = "client_error"
    code = "pull_cancelled"


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
