"""Typed settings for lance-sink: the model (`config.settings`) and its loader (`config.loader`)."""

from config.loader import (
    ConfigError,
    ConfigProblem,
    load_settings,
    problem_at,
    redacted,
    validation_problems,
)
from config.settings import Settings

__all__ = [
    "ConfigError",
    "ConfigProblem",
    "Settings",
    "load_settings",
    "problem_at",
    "redacted",
    "validation_problems",
]
