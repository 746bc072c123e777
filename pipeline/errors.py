"""The pipeline's own failures: what a stage reports in one line instead of a traceback.

A stage ends with one ``error: <Type>: <what>`` line (:func:`pipeline.cli.error_line`) exactly
when the exception is a :class:`PipelineError`: bad input the code refused (:class:`InputError`
and the errors of params, shards, sources, plans), a remote or tracking backend that cannot be
used, a guarded stop (a non-finite loss). Anything else is a bug and keeps its traceback: the
type decides, not where it was raised.
"""

from __future__ import annotations

from typing import Any


class PipelineError(Exception):
    """A failure the pipeline names in one line (bad input or a guarded stop), not a bug."""


class InputError(PipelineError, ValueError):
    """An input (a param, a file, a tensor, an argument) that the code refuses, with the reason.

    A :class:`ValueError`, so callers that catch ``ValueError`` keep working.
    """


class NonFiniteError(PipelineError, RuntimeError):
    """Training produced a NaN or an infinity (in a loss, or in the state to be saved)."""


class ParamsError(InputError):
    """A params file that does not satisfy the schema (:mod:`pipeline.config`; names the key).

    Args:
        message: the one-line message.
        key: the dotted key it is about, when one is
            (:func:`pipeline.config.check_params_file` reads it).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    @classmethod
    def invalid(cls, key: str, value: Any, allowed: str) -> ParamsError:
        """``params: 'key' = value is invalid; allowed: ...``, the schema's one-line form."""
        try:
            shown = repr(value)
        except ValueError:  # an int past Python's 4300-digit limit (read from hex)
            shown = "an integer of over 4300 digits"
        return cls(f"params: '{key}' = {shown} is invalid; allowed: {allowed}", key)
