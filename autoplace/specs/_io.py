"""Reading user files safely and turning pydantic errors into one clear line.

Every loader in autoplace goes through here, so a malformed file always becomes a
:class:`~autoplace.errors.SpecError` naming the file, the field, the bad value and
what would be valid -- never a traceback.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from autoplace.errors import SpecError

MAX_FILE_BYTES = 4 * 2**20  # a model or cluster file is a few KB; refuse anything absurd
MAX_YAML_NODES = 100_000  # guards against alias ("billion laughs") bombs

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """Base for every spec: frozen, unknown keys rejected, no silent coercion."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def read_document(path: str | Path, kind: str | None = None) -> dict[str, Any]:
    """Read a JSON, YAML or TOML file into a mapping.

    Args:
        path: the file.
        kind: ``json``, ``yaml`` or ``toml``; by default from the suffix (``.json``, ``.toml``,
            anything else YAML, a superset of JSON).

    Returns:
        The top-level mapping.

    Raises:
        SpecError: unreadable, too large, not UTF-8, not parseable, or not a mapping.
    """
    p = Path(path)
    src = str(path)
    text = read_text(p)
    kind = kind or {".json": "json", ".toml": "toml"}.get(p.suffix.lower(), "yaml")
    data = {"json": _parse_json, "yaml": _parse_yaml, "toml": _parse_toml}[kind](text, src)
    if not isinstance(data, dict):
        raise SpecError(f"top level must be a mapping of keys, got {_kind(data)}", source=src)
    return data


def read_text(path: str | Path) -> str:
    """A user's text file (a config, a list of arguments), bounded in size and decoded as UTF-8.

    Raises:
        SpecError: unreadable, larger than MAX_FILE_BYTES, or not UTF-8.
    """
    src = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise SpecError(f"cannot read file ({exc.strerror or exc})", source=src) from None
    if len(raw) > MAX_FILE_BYTES:
        raise SpecError(f"file is {len(raw)} bytes; at most {MAX_FILE_BYTES} are accepted", source=src)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"not UTF-8 text (bad byte at offset {exc.start})", source=src) from None


def read_shipped(path: Path) -> dict[str, Any]:
    """A YAML file shipped with autoplace (a hardware profile): our own file, so it is parsed
    with libyaml's safe loader when PyYAML has it -- about ten times faster than the
    pure-Python loader that guards user files (:func:`read_document`), and the same values.
    Anything libyaml cannot read goes to :func:`read_document`, which says what is wrong."""
    loader = getattr(yaml, "CSafeLoader", None)
    if loader is not None:
        try:
            data = yaml.load(path.read_text("utf-8"), Loader=loader)  # noqa: S506 - libyaml's SafeLoader
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            data = None
        if isinstance(data, dict):
            return data
    return read_document(path)


def _parse_toml(text: str, src: str) -> Any:
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"invalid TOML: {str(exc).splitlines()[0]}", source=src) from None


def _parse_json(text: str, src: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except _RepeatedKey as exc:
        raise SpecError(f"invalid JSON: {exc}", source=src) from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=src) from None
    except _ConstantError as exc:
        line, column = _line_column(text, _constant_offset(text))
        raise SpecError(f"invalid JSON at line {line} column {column}: {exc}", source=src) from None
    except (ValueError, RecursionError) as exc:
        raise SpecError(f"invalid JSON: {exc}", source=src) from None


class _RepeatedKey(ValueError):
    """A key given twice in one object: Python's json keeps the last silently."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(f"key {one_line(key)!r} given twice in one object; give it once")
        out[key] = value
    return out


class _ConstantError(ValueError):
    """NaN, Infinity or -Infinity: Python's json accepts them, JSON does not."""


def _reject_constant(name: str) -> Any:
    raise _ConstantError(f"{name} is not a valid number")


# A JSON string (skipped, so a constant's name inside one is not matched) or a bare constant.
_STRING_OR_CONSTANT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)')


def _constant_offset(text: str) -> int:
    """Offset of the first bare NaN/Infinity: the parser reads in order, so that is the one it refused."""
    for match in _STRING_OR_CONSTANT.finditer(text):
        if match.group(1):
            return match.start(1)
    return 0


def _line_column(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of a character offset."""
    return text.count("\n", 0, offset) + 1, offset - (text.rfind("\n", 0, offset) + 1) + 1


class _CountingLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents expanding to more than MAX_YAML_NODES nodes, and a key
    given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_document(self, node: yaml.Node) -> Any:
        if _count_nodes(node, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise yaml.YAMLError(f"document expands to more than {MAX_YAML_NODES} nodes (alias bomb?)")
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # a merge (<<) may override its keys; a list or mapping key is refused below
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice; give it once",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


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


MAX_FLOW_DEPTH = 256  # nested [ and { in a YAML document; real specs nest a handful


def _flow_depth(text: str) -> int:
    """The deepest nesting of YAML flow brackets, counted in one pass before any parsing: the
    parser's cost grows with it, so a hostile document is refused by this bound on work."""
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(depth - 1, 0)
    return deepest


def _parse_yaml(text: str, src: str) -> Any:
    if _flow_depth(text) > MAX_FLOW_DEPTH:
        raise SpecError(f"invalid YAML: brackets nested deeper than {MAX_FLOW_DEPTH} levels", source=src)
    try:
        return yaml.load(text, Loader=_CountingLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise SpecError(f"invalid YAML{where}: {one_line(str(exc.problem or exc))}", source=src) from None
    except yaml.reader.ReaderError as exc:  # a control character; str(exc) spans two lines
        line, column = _line_column(text, exc.position)
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise SpecError(f"invalid YAML at line {line} column {column}: unacceptable character "
                        f"#x{code:04x} ({exc.reason})", source=src) from None
    except (yaml.YAMLError, RecursionError, ValueError) as exc:
        raise SpecError(f"invalid YAML: {one_line(str(exc))}", source=src) from None


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters escaped (``\\n``), so a message stays one line.

    Printable text, non-ASCII letters included, is returned unchanged.
    """
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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
    """Turn the first pydantic error into a SpecError naming field, value and what is valid.

    For a field typed ``str | Model`` (a profile name or an inline mapping) pydantic reports
    each branch; given a mapping, the ``str`` branch's "not a string" is skipped in favour of
    the model branch's error, and branch names are dropped from the field path.
    """
    located = [(err, _locate(model, err["loc"])) for err in exc.errors(include_url=False)]
    err, where = next(((e, w) for e, w in located if not _wrong_branch(e, w)), located[0])
    dotted = ".".join([prefix, *where.path] if prefix else where.path) or None
    kind = err["type"]
    if kind == "extra_forbidden":
        valid = ", ".join(keys(where.owner)) if where.owner else "see the docs"
        return SpecError(f"unknown key; valid keys here: {valid}", source=source, field=dotted)
    if kind == "missing":
        return SpecError("required key is missing", source=source, field=dotted)
    got = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")
    if kind in _BOUND_ERRORS and where.bounds:
        msg = f"must be {where.bounds}"
    elif kind == "bool_type":
        msg = "must be true or false"
    elif kind == "string_type" and where.branches:
        msg = "must be a name or a mapping of fields"
    if isinstance(got, dict):  # a whole mapping: the message itself names the values
        return SpecError(msg, source=source, field=dotted)
    return SpecError(f"{msg} (got {_short(got)})", source=source, field=dotted)


_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


@dataclass
class _Where:
    """A pydantic error location resolved against the model tree.

    Attributes:
        path: the field path as the user wrote it (union branch names removed, keys escaped).
        owner: the model the last key was looked up in (its fields are the valid keys).
        branches: the union branches the error went through (``str``, ``GPUProfile``, ...).
        constraints: the bounds (annotated_types Ge/Gt/Le/Lt) of the field at the location.
    """

    path: list[str] = field(default_factory=list)
    owner: type[BaseModel] | None = None
    branches: list[str] = field(default_factory=list)
    constraints: list[Any] = field(default_factory=list)

    @property
    def bounds(self) -> str | None:
        """The valid range, e.g. ``in [1, 10_000]``, ``in (0, 16]`` or ``>= 0``; None when unbounded."""
        low: tuple[str, str, Any] | None = None
        high: tuple[str, str, Any] | None = None
        for c in self.constraints:
            if isinstance(c, annotated_types.Ge):
                low = ("[", ">=", c.ge)
            elif isinstance(c, annotated_types.Gt):
                low = ("(", ">", c.gt)
            elif isinstance(c, annotated_types.Le):
                high = ("]", "<=", c.le)
            elif isinstance(c, annotated_types.Lt):
                high = (")", "<", c.lt)
        if low and high:
            return f"in {low[0]}{_number(low[2])}, {_number(high[2])}{high[0]}"
        side = low or high
        return f"{side[1]} {_number(side[2])}" if side else None


def keys(model: type[BaseModel]) -> list[str]:
    """The keys a file may give ``model``: its fields, by their alias where they have one."""
    return [info.alias or name for name, info in model.model_fields.items()]


def _wrong_branch(err: Any, where: _Where) -> bool:
    """The ``str`` branch's complaint about a mapping: the model branch's error is the useful one."""
    return err["type"] == "string_type" and "str" in where.branches and isinstance(err.get("input"), Mapping)


def _locate(model: type[BaseModel], loc: tuple[Any, ...]) -> _Where:
    """Follow a pydantic error location down the model tree (see :class:`_Where`)."""
    where = _Where()
    current: Any = model
    meta: list[Any] = []
    for part in loc:
        current, more = _unwrap(current)
        members = _members(current)
        if members:  # pydantic names the union branch it tried: not part of the user's path
            where.branches.append(str(part))
            current = next((m for m in members if _branch_name(m) == str(part)), None)
            meta = []
            continue
        where.path.append(one_line(str(part)))
        meta = []
        if isinstance(current, type) and issubclass(current, BaseModel):
            where.owner = current
            info = next((f for n, f in current.model_fields.items() if (f.alias or n) == part), None)
            current, meta = (info.annotation, list(info.metadata)) if info else (None, [])
        elif isinstance(part, int) and get_origin(current) in (list, tuple):
            current = get_args(current)[0]
        else:
            current = None
    current, more = _unwrap(current)
    where.constraints = [c for m in meta + more for c in (m.metadata if isinstance(m, FieldInfo) else [m])]
    return where


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """Strip ``Annotated`` (collecting its metadata) and ``| None`` from an annotation."""
    meta: list[Any] = []
    while True:
        if get_origin(annotation) is Annotated:
            annotation, *extra = get_args(annotation)
            meta.extend(extra)
        elif len(members := _members(annotation)) == 1:
            annotation = members[0]
        else:
            return annotation, meta


def _members(annotation: Any) -> list[Any]:
    """The non-None members of a union annotation ([] for anything else)."""
    if get_origin(annotation) not in (Union, types.UnionType):
        return []
    return [a for a in get_args(annotation) if a is not type(None)]


def _branch_name(annotation: Any) -> str:
    """The name pydantic gives a union branch in an error location."""
    return getattr(_unwrap(annotation)[0], "__name__", str(annotation))


def _number(value: Any) -> str:
    """A bound for a message: integers grouped (10_000), floats short (1e-06)."""
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 10_000 else str(value)
    return f"{value:g}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    return "nothing (empty file)" if value is None else type(value).__name__
