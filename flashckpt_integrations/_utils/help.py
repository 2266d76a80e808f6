"""Plain-text ``--help`` for the command-line tools (``flashckpt``, ``flashckpt-run``)."""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":[a-z]+:`([^`]*)`")
_LITERAL = re.compile(r"``([^`]*)``|`([^`]*)`")
_UNSHOWN = (None, False, "", [], argparse.SUPPRESS)
"""Defaults that a help text describes in words (or that say nothing), rather than shows."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description and epilog as written; adds ``(default: ...)`` to an option that has a
    default and whose help does not mention one already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and "default" not in text.lower() and not _is_unshown(action.default):
            text += " (default: %(default)s)"
        return text


def _is_unshown(default: object) -> bool:
    return any(default is value or (type(default) is type(value) and default == value) for value in _UNSHOWN)


def plain_text(text: str | None) -> str | None:
    """``text`` without reST roles and literal quotes: ``--x`` and :func:`f` read as --x and f."""
    if not text or text == argparse.SUPPRESS:
        return text
    text = _ROLE.sub(r"\1", text)
    return _LITERAL.sub(lambda m: m.group(1) if m.group(1) is not None else m.group(2), text)
