"""The errors a user sees: each is one line (``Error: ...``), never a traceback.

At the bottom of the package (it imports nothing of ours) so that every layer may
raise them.
"""

from __future__ import annotations

import click
import llm


class MlxStreamError(llm.ModelError, click.ClickException):
    """A one-line error for the user.

    An ``llm.ModelError`` for Python callers and a ``click.ClickException`` so
    every CLI path (``llm prompt``, ``llm chat``, which does not catch model
    errors, and ``llm mlxs``) prints one ``Error: ...`` line, not a traceback.
    """

    def __init__(self, message: str):
        click.ClickException.__init__(self, one_line(message))

    def __str__(self) -> str:
        return self.message


class SettingsError(MlxStreamError):
    """A problem with the settings file, a settings value or a model name."""


class CheckpointError(MlxStreamError, ValueError):
    """A checkpoint that cannot be streamed; the message names the file."""


def one_line(exc: BaseException | str) -> str:
    """An exception's message (or a text) on one line; the type name if it has none."""
    text = " ".join(str(exc).split())
    if text or isinstance(exc, str):
        return text
    return type(exc).__name__
