"""Load `Settings` from a config file, the environment and CLI overrides.

Precedence, lowest first: defaults < config file < environment < CLI flags. Every problem
is reported with the dotted key, where the value came from (the file, an environment
variable, a CLI flag or a missing required key) and the reason; `ConfigError` carries all
of them at once so an operator fixes a file in one pass.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from config.settings import (
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    KeyedError,
    Settings,
    mask_librdkafka_secrets,
)


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One invalid or missing setting; `related`: the other keys a check across keys
    involves, each with its origin."""

    key: str
    origin: str
    reason: str
    related: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        text = f"{self.key or '<root>'} ({self.origin}): {self.reason}"
        if self.related:
            text += "; with " + ", ".join(f"{key} ({origin})" for key, origin in self.related)
        return text


class ConfigError(Exception):
    """The configuration is invalid; `problems` lists every offending key."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  {p}" for p in problems))


class _MappingSource(PydanticBaseSettingsSource):
    """A settings source backed by an already-parsed mapping (the config file)."""

    def __init__(self, settings_cls: type[BaseSettings], data: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = dict(data)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return self._data


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML (.toml) or YAML (.yaml/.yml) config file into a mapping.

    Raises:
        ConfigError: the file is missing, unreadable, not parseable, or not a mapping.
    """
    origin = f"file {path}"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([ConfigProblem("", origin, f"cannot read: {exc.strerror}")]) from exc
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        reason = (
            f"not valid UTF-8: byte 0x{exc.object[exc.start]:02x} at line {line} "
            f"(byte offset {exc.start}); save the file as UTF-8"
        )
        raise ConfigError([ConfigProblem("", origin, reason)]) from exc
    try:
        if path.suffix in {".yaml", ".yml"}:
            data = yaml.safe_load(text) or {}
        else:
            data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError([ConfigProblem("", origin, f"cannot parse: {exc}")]) from exc
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem("", origin, "the top level must be a mapping")])
    return data


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """Parse a CLI override `section.key=value`; the value is read as a TOML value if it
    parses as one (numbers, booleans, arrays, quoted strings), else as a bare string.

    Raises:
        ConfigError: the assignment has no `=` or no key.
    """
    key, sep, raw = assignment.partition("=")
    path = [p for p in key.strip().split(".") if p]
    if not sep or not path:
        raise ConfigError(
            [ConfigProblem(key, f"flag --set {assignment}", "expected section.key=value")]
        )
    try:
        value: Any = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def load_settings(
    path: Path | None = None,
    overrides: list[str] | None = None,
) -> Settings:
    """Build the settings from `path`, `os.environ` and `--set` overrides.

    Args:
        path: config file (TOML or YAML); None = environment and overrides only.
        overrides: `section.key=value` assignments from the command line.

    Raises:
        ConfigError: with one `ConfigProblem` per invalid or missing key.
    """
    file_data = read_config_file(path) if path is not None else {}
    cli_data = _overrides_data(overrides)

    class _Loaded(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            # First wins: CLI flags, then environment, then the file.
            return init_settings, env_settings, _MappingSource(settings_cls, file_data)

    unknown = _unknown_env_sections(os.environ)
    try:
        settings = _Loaded(**cli_data)
    except ValidationError as exc:
        problems = unknown + _problems(exc, path, file_data, cli_data, os.environ)
        raise ConfigError(problems) from exc
    if unknown:
        raise ConfigError(unknown)
    return settings


def _unknown_env_sections(env: Mapping[str, str]) -> list[ConfigProblem]:
    """A problem per `LANCE_SINK__<SECTION>__...` variable whose section the settings do not
    have. pydantic-settings reads only the variables of known sections, so a misspelled
    section (`LANCE_SINK__MEMTABEL__MAX_ROWS`) would be ignored without a word, where a
    misspelled key inside a known section is refused as an extra input."""
    sections = list(Settings.model_fields)
    problems = []
    for var in sorted(env):
        if not var.upper().startswith(ENV_PREFIX):
            continue
        section = var[len(ENV_PREFIX) :].split(ENV_NESTED_DELIMITER, 1)[0].lower()
        if section in Settings.model_fields:
            continue
        close = difflib.get_close_matches(section, sections, n=1)
        hint = f"did you mean {ENV_PREFIX}{close[0].upper()}? " if close else ""
        reason = (
            f"{section!r} is not a section of the settings ({hint}the sections are "
            + ", ".join(sections)
            + ")"
        )
        problems.append(ConfigProblem(section, f"environment {var}", reason))
    return problems


def _overrides_data(overrides: list[str] | None) -> dict[str, Any]:
    cli_data: dict[str, Any] = {}
    for assignment in overrides or []:
        keys, value = parse_override(assignment)
        node = cli_data
        for part in keys[:-1]:
            node = node.setdefault(part, {})
        node[keys[-1]] = value
    return cli_data


def problem_at(
    key: str, reason: str, path: Path | None = None, overrides: list[str] | None = None
) -> ConfigProblem:
    """A problem with the loaded value of `key` found after loading (e.g. when `check-config`
    builds what the setting names), with its origin worked out as `load_settings` does."""
    file_data = read_config_file(path) if path is not None else {}
    loc = key.split(".")
    env_upper = {k.upper() for k in os.environ}
    origin = _origin(loc, path, file_data, _overrides_data(overrides), env_upper)
    return ConfigProblem(key, origin, reason)


def validation_problems(
    exc: ValidationError, path: Path | None = None, overrides: list[str] | None = None
) -> list[ConfigProblem]:
    """The problems of settings validated after loading (e.g. with columns derived from a
    schema), with their origins worked out as `load_settings` does."""
    file_data = read_config_file(path) if path is not None else {}
    return _problems(exc, path, file_data, _overrides_data(overrides), os.environ)


def _problems(
    exc: ValidationError,
    path: Path | None,
    file_data: Mapping[str, Any],
    cli_data: Mapping[str, Any],
    env: Mapping[str, str],
) -> list[ConfigProblem]:
    problems = []
    env_upper = {k.upper() for k in env}
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        cause = (err.get("ctx") or {}).get("error")
        related: list[tuple[str, str]] = []
        if isinstance(cause, KeyedError):  # a check across keys: its keys, under its model
            for other in cause.also:
                other_loc = [*loc, *other.split(".")]
                origin = _origin(other_loc, path, file_data, cli_data, env_upper)
                related.append((".".join(other_loc), origin))
            loc = [*loc, *cause.key.split(".")]
        key = ".".join(loc)
        reason = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            reason = "required key is missing"
        origin = _origin(loc, path, file_data, cli_data, env_upper)
        problems.append(ConfigProblem(key, origin, reason, tuple(related)))
    return problems


def _origin(
    loc: list[str],
    path: Path | None,
    file_data: Mapping[str, Any],
    cli_data: Mapping[str, Any],
    env_upper: set[str],
) -> str:
    """Say which source supplied the value at `loc` (highest precedence first)."""
    if not loc:
        return "the configuration as a whole"
    if _has(cli_data, loc):
        return "flag --set " + ".".join(loc)
    var = ENV_PREFIX + ENV_NESTED_DELIMITER.join(p.upper() for p in loc)
    if var in env_upper:
        return f"environment {var}"
    in_file = path is not None and _has(file_data, loc)
    # A section may be filled from both: name the variables that set keys inside it.
    inner = (
        sorted(v for v in env_upper if v.startswith(var + ENV_NESTED_DELIMITER))
        if len(loc) > 1
        else []
    )
    if inner:
        env = "environment " + ", ".join(inner)
        return f"file {path} and {env}" if in_file else env
    if in_file:
        return f"file {path}"
    if path is not None:
        return f"not set in file {path}"
    return "not set"


def _has(data: Mapping[str, Any], loc: list[str]) -> bool:
    node: Any = data
    for part in loc:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


#: Settings fields holding librdkafka pass-through properties, wherever they are in the tree
#: (`kafka.librdkafka`, and any other section's): their secret-holding keys are masked.
LIBRDKAFKA_FIELD = "librdkafka"


def redacted(settings: Settings) -> dict[str, Any]:
    """The effective configuration as plain data with every secret masked: `SecretStr`
    fields (typed secrets, object-store `storage_options`) and the secret-holding keys of
    every librdkafka pass-through map (`mask_librdkafka_secrets`)."""
    return _mask_pass_through(settings.model_dump(mode="json"))


def _mask_pass_through(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == LIBRDKAFKA_FIELD and isinstance(value, dict):
            out[key] = mask_librdkafka_secrets(value)
        elif isinstance(value, dict):
            out[key] = _mask_pass_through(value)
        else:
            out[key] = value
    return out
