"""Errors that stop a service at start-up: the message alone says what is wrong, no traceback needed."""

from __future__ import annotations


class StartupError(ValueError):
    """A model directory, checkpoint or pairing that cannot be served; the message names the field or tensor."""
