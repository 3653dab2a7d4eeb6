"""What benchmarks/fuzz.py's surfaces share: the input (:class:`Case`), hostile values, and
documents mutated one to three times, written as JSON, YAML or TOML (or with a key given twice).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TINY = EXAMPLES / "models" / "tiny-llama.json"
LLAMA = EXAMPLES / "models" / "llama-3-8b.json"
A100 = EXAMPLES / "clusters" / "1x8-a100-80gb.yaml"
HF = REPO / "tests" / "data" / "hf"
UNKNOWN_KEY = "zz_not_a_key"
ONE_GPU = "{one-gpu.yaml}"  # a 1-GPU cluster every case may name (it divides any batch)
ONE_GPU_TEXT = "name: one\nnodes: 1\ngpus_per_node: 1\ngpu: h100-sxm5-80gb\nintra_node: nvlink4\n"
# Values swapped in for a field: wrong types, bounds, and what issue 36 found crashing ``check``
# (1e308 for a degree, [] / "" / [2**40] / [1e308] / [33] for layers_per_stage, 2.0 taken as 2).
BAD: list[Any] = ["bogus", "", "auto", [1], [], {"a": 1}, {}, None, True, False, -1, -0.5, 0, 0.5, 1, 2, 3, 7, 10**30,
                  -10**30, 2**63, math.nan, math.inf, -math.inf, "1e400", "8x8xh100", 1e308, 2.0, 2**31, 2**40,
                  [2**40], [1e308], [33], [0], [-1], [1, 1], [2.0], ["none"]]


@dataclass(frozen=True)
class Case:
    """One input: the surface, the files it writes (name -> bytes) and the CLI arguments
    (``{name}`` is replaced by the file's path, ``{work}`` by the work directory).

    ``expect``: when given, the input is bad by construction (a key given twice, a flag out of
    its range): it must exit 2 with this text on its one error line.
    """

    surface: str
    files: tuple[tuple[str, bytes], ...]
    args: tuple[str, ...]
    expect: str = ""


def calibration_seed() -> dict[str, Any]:
    """A calibration file (``autoplace calibrate``'s output) measured on the 1-GPU cluster."""
    return {"schema": "autoplace.calibration/v1",
            "measured_on": {"gpu": "h100-sxm5-80gb", "gpus_per_node": 1, "intra_node": "nvlink4",
                            "inter_node": "ib-ndr", "framework": "native"},
            "assumptions": {"compute_scale": 0.9, "bandwidth_scale": 1.1, "overlap_slowdown": 0.2},
            "uncertainty": {"log_sigma": 0.1, "band_95": [0.8, 1.25]},
            "fit": {"trials": 5, "objective": "least squares on log step time", "error_before": 0.2,
                    "error_after": 0.1}}


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key and index path in a document."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out = []
    for key, value in items:
        out.append((*prefix, key))
        out.extend(paths(value, (*prefix, key)))
    return out


def mutate(doc: Any, path: tuple[Any, ...], op: str, value: Any) -> Any:
    """A deep copy of ``doc`` with one change at ``path``: ``del``, ``set`` or ``add`` (an unknown key)."""
    doc = json.loads(json.dumps(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    target = parent[path[-1]] if path else doc
    if op == "add" and isinstance(target, dict):
        target[UNKNOWN_KEY] = value
    elif op == "del" and path:
        del parent[path[-1]]
    elif op == "set" and path:
        parent[path[-1]] = value
    return doc


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | st.text(max_size=8),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                       max_leaves=12)


@st.composite
def mutated(draw: st.DrawFn, seeds: list[Any]) -> Any:
    """A seed document with one to three changes."""
    doc = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 3))):
        found: list[tuple[Any, ...]] = paths(doc)
        at_root = not found or draw(st.integers(0, 5)) == 0  # the root: only an unknown key can go there
        path: tuple[Any, ...] = () if at_root else draw(st.sampled_from(found))
        op = draw(st.sampled_from(["del", "set", "set", "add"]))
        doc = mutate(doc, path, op, draw(st.sampled_from(BAD) | JSONISH))
    return doc


def dump(doc: Any, suffix: str) -> bytes:
    if suffix == ".json":
        return json.dumps(doc, allow_nan=True).encode()
    if suffix == ".toml":
        return toml(doc).encode()
    return yaml.safe_dump(doc, allow_unicode=True).encode()


def toml(doc: Any, prefix: str = "") -> str:
    """A small TOML writer (tomllib reads only): tables of scalars and lists; anything else as a string."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return "nan" if v != v else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v if not isinstance(x, dict) and x is not None) + "]"
        return json.dumps(str(v))
    if not isinstance(doc, dict):
        return f"x = {value(doc)}\n"
    lines = [f"{json.dumps(str(k))} = {value(v)}" for k, v in doc.items() if not isinstance(v, dict) and v is not None]
    for k, v in doc.items():
        if isinstance(v, dict):
            name = f"{prefix}.{json.dumps(str(k))}" if prefix else json.dumps(str(k))
            lines.append(f"\n[{name}]\n" + toml(v, name))
    return "\n".join(lines) + "\n"


def json_repeating(doc: Any, at: tuple[Any, ...], which: int, value: Any) -> str:
    """JSON text of ``doc`` whose mapping at ``at`` names its key number ``which`` (modulo its
    size) once more, with ``value``: a document no JSON writer makes, and Python's reader
    silently keeps the last value of."""
    def encode(node: Any, path: tuple[Any, ...]) -> str:
        if isinstance(node, dict):
            items = [(str(k), encode(v, (*path, k))) for k, v in node.items()]
            if path == at and items:
                items.append((items[which % len(items)][0], json.dumps(value)))
            return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in items) + "}"
        if isinstance(node, list):
            return "[" + ", ".join(encode(v, (*path, i)) for i, v in enumerate(node)) + "]"
        return json.dumps(node)

    return encode(doc, ())


@st.composite
def repeating(draw: st.DrawFn, seeds: list[Any]) -> str:
    """A seed document as JSON text with one of its mappings naming a key twice."""
    doc = draw(st.sampled_from(seeds))
    mappings = [(), *(p for p in paths(doc) if isinstance(_at(doc, p), dict) and _at(doc, p))]
    value = draw(st.sampled_from(BAD[:20]) | st.integers() | st.text(max_size=8) | st.booleans())  # no NaN: not JSON
    return json_repeating(doc, draw(st.sampled_from(mappings)), draw(st.integers(0, 63)), value)


def _at(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def file_case(surface: str, suffix: str, args: list[str], expect: str = "") -> Callable[[bytes], Case]:
    return lambda data: Case(surface, (("input" + suffix, data),), tuple(args), expect)


def garbage(suffix: str) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=200), JSONISH.map(lambda d: dump(d, suffix)),
                     st.lists(st.sampled_from(["{", "}", "[", "]", ":", ",", "-", " ", "\n", "a", "1", "'", '"',
                                               "&a", "*a", "!!python/object", "=", "[[x]]", "#"]), max_size=30)
                     .map(lambda t: "".join(t).encode()))
