"""Megatron-LM core_v0.16.1's command line as data: every flag its parser defines, and how it parses.

``pretrain_gpt.py`` parses its words with ``megatron/training/arguments.py: parse_args`` (Megatron-LM's
training code, not on PyPI).  Its parser has 650 flags, about half generated from dataclasses
(megatron-core's ``TransformerConfig`` and Megatron-LM's own ``TrainingConfig``, ``CheckpointConfig``,
...).  The table ``megatron_lm_flags.json`` records, per flag, what that parser was built with
(option strings, destination, action, nargs, type, default, choices), read off Megatron-LM's own
parser by :func:`main` from a checkout; :func:`parse_words` rebuilds the same argparse parser from
it, so a launch's words parse here as they parse in ``pretrain_gpt.py``: the same defaults, the same
refusals ("unrecognized arguments: ...", an invalid choice), the same ``args`` namespace.

Regenerate (a Megatron-LM checkout at the tag, megatron-core of the same version installed)::

    python -m autoplace.frameworks._megatron_flags /path/to/Megatron-LM
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("megatron_lm_flags.json")
VERSION = "core_v0.16.1"


class MegatronArgumentError(ValueError):
    """Megatron-LM's parser refused the words (argparse's own message: an unknown flag, a bad value)."""


class _Parser(argparse.ArgumentParser):
    """argparse as ``parse_args`` builds it (``allow_abbrev=False``), raising instead of exiting."""

    def error(self, message: str) -> Any:  # argparse calls this with its own message, then exits
        raise MegatronArgumentError(f"pretrain_gpt.py: error: {message}")


def parse_words(words: Sequence[str]) -> argparse.Namespace:
    """The namespace Megatron-LM's ``parse_args`` makes of ``words`` (before ``validate_args``).

    Raises:
        MegatronArgumentError: a word the parser refuses, with argparse's message.
    """
    args = _parser().parse_args(list(words))
    for name, value in vars(args).items():  # a list default is one object per parser: each parse its own copy
        if isinstance(value, list):
            setattr(args, name, list(value))
    return args


def value_type(option: str) -> str | None:
    """The type name ("int", "float", "str", ...) of the value ``option`` takes; None for a switch or an
    unknown flag."""
    action = next((a for a in _parser()._actions if option in a.option_strings), None)
    return None if action is None or action.nargs == 0 else _kinds().get(action.dest)


def option(dest: str) -> str | None:
    """The flag that sets ``args.<dest>`` ("micro_batch_size" -> "--micro-batch-size"); None when no flag does."""
    return next((a.option_strings[0] for a in _parser()._actions if a.dest == dest and a.option_strings), None)


@cache
def _kinds() -> dict[str, str | None]:
    return {flag["dest"]: flag["type"] for flag in json.loads(TABLE.read_text())["flags"]}


@cache
def _parser() -> _Parser:
    parser = _Parser(description="Megatron-LM Arguments", allow_abbrev=False, add_help=False)
    for flag in json.loads(TABLE.read_text())["flags"]:
        parser.add_argument(*flag["flags"], **_kwargs(flag))
    return parser


def _kwargs(flag: dict[str, Any]) -> dict[str, Any]:
    """add_argument's keywords for one table row."""
    action = flag["action"]
    kwargs: dict[str, Any] = {"dest": flag["dest"], "default": _value(flag["type"], flag["default"])}
    if action == "boolean_optional":
        return {**kwargs, "action": argparse.BooleanOptionalAction}
    if action in ("store_true", "store_false"):
        return {**kwargs, "action": action}
    kwargs["type"] = _converter(flag["type"])
    if flag["nargs"] is not None:
        kwargs["nargs"] = flag["nargs"]
    if flag["choices"] is not None:
        kwargs["choices"] = [_value(flag["type"], c) for c in flag["choices"]]
    return kwargs


def _value(kind: str | None, value: Any) -> Any:
    """A default or choice as the parser holds it (enum members are stored by name)."""
    if kind and kind.startswith("enum:") and isinstance(value, str):
        return _enum(kind[5:])[value]
    return value


def _enum(name: str) -> Any:
    if name == "Signals":
        import signal

        return signal.Signals
    from megatron.core.transformer import enums

    return getattr(enums, name)


def _converter(kind: str | None) -> Callable[[str], Any] | None:
    """The ``type=`` of a flag (arguments.py's own converters, restated: tuple_type, *_freq_type)."""
    if kind is None:
        return None
    simple: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "bool": bool,
                                                "tuple": tuple_type, "freq": freq_type}
    if kind in simple:
        return simple[kind]
    if kind == "cuda_graph_scope":  # '--cuda-graph-scope': CudaGraphScope[name], except the deprecated "full"
        return lambda scope: scope if scope == "full" else _enum("CudaGraphScope")[scope]
    if kind.startswith("enum:"):
        members = _enum(kind[5:])
        return lambda text: members[text]
    raise ValueError(f"{TABLE.name}: unknown type {kind!r}")


def tuple_type(text: str) -> tuple[int, ...]:
    """arguments.py ``tuple_type``: "1,2" or "(1,2)" -> (1, 2)."""
    return tuple(int(i) for i in text.strip("()").split(","))


_PATTERN = re.compile(r"[^,\d\[\]\(\)\+\*]")


def freq_type(text: str) -> int | list[int]:
    """arguments.py ``moe_freq_type`` / ``no_rope_freq_type`` / ``la_freq_type``: an integer N, or a
    list pattern such as "([1]*3+[0]*1)*3" (digits, brackets, commas, + and * only)."""
    if "[" not in text:
        return int(text)
    if _PATTERN.search(text):
        raise ValueError(f"Invalid pattern: {text}")
    return _list_pattern(text)


def _list_pattern(text: str) -> list[int]:
    """Evaluate a pattern of integer lists joined by + and repeated by *, without eval."""
    value, rest = _sum(text.replace(" ", ""))
    if rest or not isinstance(value, list):
        raise ValueError(f"Invalid pattern: {text}")
    return value


def _sum(text: str) -> tuple[Any, str]:
    value, text = _product(text)
    while text.startswith("+"):
        more, text = _product(text[1:])
        value = value + more
    return value, text


def _product(text: str) -> tuple[Any, str]:
    value, text = _atom(text)
    while text.startswith("*"):
        more, text = _atom(text[1:])
        value = value * more
    return value, text


def _atom(text: str) -> tuple[Any, str]:
    if text.startswith("("):
        value, text = _sum(text[1:])
        return value, text[1:] if text.startswith(")") else _bad(text)
    if text.startswith("["):
        items: list[int] = []
        text = text[1:]
        while not text.startswith("]"):
            item, text = _sum(text)
            items.append(item)
            text = text[1:] if text.startswith(",") else text
            if not text:
                _bad(text)
        return items, text[1:]
    digits = re.match(r"\d+", text)
    if not digits:
        _bad(text)
    assert digits is not None  # _bad raised
    return int(digits.group()), text[digits.end():]


def _bad(text: str) -> Any:
    raise ValueError(f"Invalid pattern near {text!r}")


# ------------------------------------------------------------------ regenerating the table


def read_parser(checkout: Path) -> dict[str, Any]:
    """The table, read off Megatron-LM's own ``add_megatron_arguments`` in ``checkout``.

    Only ``megatron/training/arguments.py`` and the config modules it imports are loaded (not the
    package's ``__init__``, which imports the training loop and its CUDA kernels).
    """
    import types

    sys.path.append(str(checkout))
    import megatron

    megatron.__path__.append(str(checkout / "megatron"))
    training = types.ModuleType("megatron.training")
    training.__path__ = [str(checkout / "megatron" / "training")]
    for name in ("get_args", "get_timers", "get_adlr_autoresume", "get_tokenizer", "print_rank_0"):
        setattr(training, name, None)  # names megatron/training/utils.py imports from the package
    sys.modules["megatron.training"] = training
    sys.modules.setdefault("six", types.ModuleType("six"))  # the BERT tokenizer's import, unused here
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    rows = [_row(a) for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    return {"source": f"Megatron-LM {VERSION} megatron/training/arguments.py add_megatron_arguments",
            "flags": rows}


def _row(action: argparse.Action) -> dict[str, Any]:
    kinds = {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false",
             "BooleanOptionalAction": "boolean_optional"}
    kind = kinds[type(action).__name__]
    type_name = _type_name(action)
    return {"flags": [s for s in action.option_strings if not s.startswith("--no-")]
            if kind == "boolean_optional" else list(action.option_strings),
            "dest": action.dest, "action": kind, "nargs": action.nargs, "type": type_name,
            "default": _plain(action.default), "choices": None if action.choices is None
            else [_plain(c) for c in action.choices]}


def _type_name(action: argparse.Action) -> str | None:
    t = action.type
    if t is None or isinstance(action, argparse.BooleanOptionalAction):
        return None
    name = getattr(t, "__name__", "")
    if name in ("int", "float", "str", "bool"):
        return name
    if name == "tuple_type":
        return "tuple"
    if name.endswith("_freq_type"):
        return "freq"
    if name == "<lambda>" and action.dest == "cuda_graph_scope":
        return "cuda_graph_scope"
    if name == "enum_type_handler" or action.dest == "exit_signal":
        members = type(action.default) if action.default is not None else type(action.choices[0])  # type: ignore[index]
        return f"enum:{members.__name__}"
    raise ValueError(f"{action.dest}: a type the table cannot record: {t!r}")


def _plain(value: Any) -> Any:
    import enum

    return value.name if isinstance(value, enum.Enum) else value


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    table = read_parser(Path(argv[0]).resolve())
    rows = ",\n".join(json.dumps(row) for row in table["flags"])  # one flag a line: diffs show what changed
    TABLE.write_text(f'{{"source": {json.dumps(table["source"])},\n"flags": [\n{rows}\n]}}\n')
    print(f"{TABLE}: {len(table['flags'])} flags")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
