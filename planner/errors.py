"""Errors for bad input. Raised, never asserted; the CLI prints one line and exits with code 2."""

from __future__ import annotations

from cost_models.specs import SpecError


class PlannerError(SpecError):
    """Bad user input: `field` names the input, the message says what is valid."""


class ModelNotFound(PlannerError):
    pass


class UnsupportedModel(PlannerError):
    pass
