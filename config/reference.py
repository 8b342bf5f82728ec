"""The configuration reference, generated from the settings model so it cannot drift.

    python -m config.reference            print the reference (Markdown)
    python -m config.reference --write    rewrite it inside README.md between the markers

A test regenerates it and fails when README.md differs.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from config.settings import ENV_NESTED_DELIMITER, ENV_PREFIX, Settings

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        optional = any(a is type(None) for a in args)
        return " \\| ".join(names) + (" (optional)" if optional else "")
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"table of {_type_name(args[1])}" if args else "table"
    if annotation is SecretStr:
        return "secret string"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table"
    name = getattr(annotation, "__name__", str(annotation))
    return {
        "ByteSize": "size (bytes or '64MiB')",
        "str": "string",
        "int": "integer",
        "float": "number",
        "bool": "boolean",
    }.get(name, name)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{value!r}`" if value not in ({}, []) else "empty"
    value = field.default
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model(arg)
        if found is not None:
            return found
    return None


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    nested = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        sub = _model(field.annotation)
        if sub is not None and sub is not model and typing.get_origin(field.annotation) is not list:
            nested.append((key, sub, field))
            continue
        doc = (field.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {doc} |")
    for key, sub, _field in nested:
        rows += _rows(sub, key)
    return rows


def reference() -> str:
    """The whole reference as Markdown: one table per section."""
    intro = (
        "Every key, its type, default and meaning. Environment variables use the prefix "
        f"`{ENV_PREFIX}` and `{ENV_NESTED_DELIMITER}` between levels "
        f"(`{ENV_PREFIX}KAFKA{ENV_NESTED_DELIMITER}GROUP_ID`)."
    )
    out = [intro, ""]
    for name, field in Settings.model_fields.items():
        model = _model(field.annotation)
        if model is None:
            continue
        out += [f"#### `[{name}]`", ""]
        if model.__doc__:
            out += [model.__doc__.strip().splitlines()[0], ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        out += _rows(model, name)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def splice(readme: str, body: str) -> str:
    """README text with the reference between the markers replaced by `body`."""
    head, _, rest = readme.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{body}{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description="Print or write the configuration reference.")
    parser.add_argument("--write", type=Path, nargs="?", const=Path("README.md"), default=None)
    args = parser.parse_args()
    body = reference()
    if args.write is None:
        sys.stdout.write(body)
        return
    text = args.write.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{args.write} has no {START} ... {END} markers")
    args.write.write_text(splice(text, body))


if __name__ == "__main__":
    main()
