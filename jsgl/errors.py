"""Errors that every layer may raise and the server maps to HTTP statuses, and the refusals the `jsgl` command
reports on one line.

They live at the package root so that `fsm/`, `engine/` and `server/` can all import them without a
layer importing from the one above it.
"""

from __future__ import annotations


class RefusedError(Exception):
    """jsgl stops on purpose: a model, option, device or environment it does not run with. The message names the
    problem and the fix; the `jsgl` command prints it as one line and exits 2, without a traceback (jsgl/cli.py).
    Subclasses keep the built-in base their callers catch (ValueError, FileNotFoundError, ImportError)."""


class ConfigError(RefusedError, ValueError):
    """Engine options (EngineConfig fields, the command's flags) that are invalid, do not fit together, or do not
    fit this machine (an absent device, no room for a KV pool)."""


class ModelNotFoundError(RefusedError, FileNotFoundError):
    """A model name that resolves to no model jsgl can read: no such alias, file or folder, or a Hub id that is
    neither in the local cache nor fetchable."""


class MissingExtraError(RefusedError, ImportError):
    """An optional dependency a feature needs is not installed; the message says what to pip install."""


class UnsafeCacheError(RefusedError):
    """A cache directory (or its key) that another user could write into: jsgl runs code it loads from there.
    No built-in base on purpose: the caches' ``except OSError`` (a read-only or full disk) must not swallow it."""


class InvalidRequestError(RefusedError, ValueError):
    """Bad input from a caller; the engine rejects the request and keeps serving (HTTP 400)."""


class ConstraintBudgetError(InvalidRequestError):
    """A regex / JSON schema whose token index would exceed the server's size or time budget (HTTP 400)."""


class OverloadedError(RuntimeError):
    """The server is at a configured limit (concurrent requests, queued constraint builds): retry later
    (HTTP 503)."""


class GenerationError(RuntimeError):
    """A request the engine accepted did not complete (a language backend raises it for a failed `gen`).

    `reason` is the engine's AbortReason value ("client", "shutdown", "invalid_request", "step_failed")
    when known; `request_id` names the request in the server's log.
    """

    def __init__(self, message: str, request_id: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.request_id, self.reason = request_id, reason
