"""Reading user files safely and turning pydantic errors into one clear line.

Every loader in autoplace goes through here, so a malformed file always becomes a
:class:`~autoplace.errors.SpecError` naming the file, the field, the bad value and
what would be valid -- never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from autoplace.errors import SpecError

MAX_FILE_BYTES = 4 * 2**20  # a model or cluster file is a few KB; refuse anything absurd
MAX_YAML_NODES = 100_000  # guards against alias ("billion laughs") bombs

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """Base for every spec: frozen, unknown keys rejected, no silent coercion."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def read_document(path: str | Path) -> dict[str, Any]:
    """Read a JSON or YAML file into a mapping.

    Args:
        path: the file; ``.json`` is parsed as JSON, anything else as YAML (a superset).

    Returns:
        The top-level mapping.

    Raises:
        SpecError: unreadable, too large, not UTF-8, not parseable, or not a mapping.
    """
    p = Path(path)
    src = str(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise SpecError(f"cannot read file ({exc.strerror or exc})", source=src) from None
    if len(raw) > MAX_FILE_BYTES:
        raise SpecError(f"file is {len(raw)} bytes; at most {MAX_FILE_BYTES} are accepted", source=src)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"not UTF-8 text (bad byte at offset {exc.start})", source=src) from None
    data = _parse_json(text, src) if p.suffix.lower() == ".json" else _parse_yaml(text, src)
    if not isinstance(data, dict):
        raise SpecError(f"top level must be a mapping of keys, got {_kind(data)}", source=src)
    return data


def _parse_json(text: str, src: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise SpecError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=src) from None
    except (ValueError, RecursionError) as exc:
        raise SpecError(f"invalid JSON: {exc}", source=src) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid number")


class _CountingLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents expanding to more than MAX_YAML_NODES nodes."""

    def construct_document(self, node: yaml.Node) -> Any:
        if _count_nodes(node, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise yaml.YAMLError(f"document expands to more than {MAX_YAML_NODES} nodes (alias bomb?)")
        return super().construct_document(node)


def _count_nodes(root: yaml.Node, limit: int) -> int:
    # Aliases share node objects, so counting visits (not ids) measures the expanded size.
    count, stack = 0, [root]
    while stack and count <= limit:
        node = stack.pop()
        count += 1
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.extend((key, value))
    return count


def _parse_yaml(text: str, src: str) -> Any:
    try:
        return yaml.load(text, Loader=_CountingLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise SpecError(f"invalid YAML{where}: {exc.problem or exc}", source=src) from None
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        raise SpecError(f"invalid YAML: {exc}", source=src) from None


def validate(model: type[M], data: Any, *, source: str, prefix: str = "") -> M:
    """Validate ``data`` against a pydantic model, raising a one-line SpecError.

    Args:
        model: the Strict subclass to build.
        data: parsed input.
        source: file name (or option) for the message.
        prefix: dotted path of ``data`` inside its document, for nested validation.
    """
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise spec_error_from(exc, model, source=source, prefix=prefix) from None


def spec_error_from(exc: ValidationError, model: type[BaseModel], *, source: str, prefix: str = "") -> SpecError:
    """Turn the first pydantic error into a SpecError naming field, value and what is valid."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    field = ".".join([prefix, *loc] if prefix else loc) or None
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _model_at(model, err["loc"][:-1])
        valid = ", ".join(owner.model_fields) if owner else "see the docs"
        return SpecError(f"unknown key; valid keys here: {valid}", source=source, field=field)
    if kind == "missing":
        return SpecError("required key is missing", source=source, field=field)
    got = err.get("input")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if isinstance(got, dict):  # a whole mapping: the message itself names the values
        return SpecError(msg, source=source, field=field)
    return SpecError(f"{msg} (got {_short(got)})", source=source, field=field)


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """Follow a pydantic error location down nested models to the one that owns the key."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or current is None:
            continue
        field = current.model_fields.get(str(part)) if isinstance(current, type) and issubclass(current, BaseModel) else None
        if field is None:
            return None
        current = _inner_model(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _inner_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    return "nothing (empty file)" if value is None else type(value).__name__
