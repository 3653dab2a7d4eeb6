"""Strict accessors the config readers share: load a file, check keys, read typed values.

Every failure is a :class:`SpecError` naming the file (``source``) and the dotted key
(``field``), so ``autoplace check`` can print one line a user can act on.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from autoplace.errors import SpecError
from autoplace.plan import count_at
from autoplace.specs._io import read_document

Doc = Mapping[str, Any]


def load(cfg: Doc | str | Path, kind: str, default_source: str) -> tuple[Doc, str]:
    """A parsed config and the name errors should cite.

    Args:
        cfg: an already parsed mapping, or a path to a JSON / YAML / TOML file.
        kind: ``json``, ``yaml`` or ``toml`` (how a path is parsed).
        default_source: the name used for a mapping given directly.
    """
    if isinstance(cfg, Mapping):
        return cfg, default_source
    return read_document(cfg, kind), str(cfg)



def check_keys(doc: Doc, known: Collection[str], src: str, prefix: str, why: str = "") -> None:
    """Reject keys of ``doc`` not in ``known``, suggesting the closest valid one."""
    for key in doc:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SpecError(f"unknown key{why}{hint}", source=src, field=f"{prefix}{key}")


def section(doc: Doc, key: str, src: str, prefix: str = "") -> Doc:
    """``doc[key]`` as a mapping ({} when absent)."""
    value = doc.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"expected a mapping, got {value!r}", source=src, field=f"{prefix}{key}")
    return value


def integer(doc: Doc, key: str, src: str, prefix: str = "", *, default: int | None = None,
            minimum: int = 1) -> int | None:
    """An integer in [``minimum``, 2**31) as the file writes it (:func:`autoplace.plan.count_at`: not
    a boolean, not a float such as 8.0 -- the degrees and batch sizes read here are ints to the
    frameworks too: DeepSpeed's ``range(gas)``, torchtitan's dataclass fields), or ``default`` when
    absent; "auto" is named as the Hugging Face Trainer's."""
    if key not in doc or doc[key] is None:
        return default
    value = doc[key]
    if value == "auto":
        raise SpecError('"auto" is filled in only by the Hugging Face Trainer; give a number',
                        source=src, field=f"{prefix}{key}")
    return count_at(value, minimum=minimum, source=src, field=f"{prefix}{key}")


def boolean(doc: Doc, key: str, src: str, prefix: str = "", *, default: bool = False) -> bool:
    """A true/false value (YAML/TOML/JSON booleans only)."""
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"expected true or false, got {value!r}", source=src, field=f"{prefix}{key}")
    return value


def choice(doc: Doc, key: str, choices: Collection[str], src: str, prefix: str = "", *, default: str) -> str:
    """One of ``choices`` (the message lists them)."""
    value = doc.get(key, default)
    if isinstance(value, (list, dict)) or value not in choices:  # a list or mapping is not hashable, nor a choice
        raise SpecError(f"{value!r} is not valid; valid: {', '.join(map(str, choices))}",
                        source=src, field=f"{prefix}{key}")
    return str(value)


def check_dtype(found: str, expected: str, src: str, field: str) -> None:
    """The config's training dtype must match the model's precision recipe."""
    if found != expected:
        raise SpecError(f"the config trains in {found} but the model's precision recipe trains in {expected}; "
                        "set training.precision in the model file to match", source=src, field=field)


def split_data_parallel(dp: int, shard: int, src: str, field: str) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for a shard group of ``shard`` ranks inside ``dp``."""
    if shard < 1 or dp % shard:
        raise SpecError(f"the shard group ({shard}) must divide the data-parallel size ({dp})",
                        source=src, field=field)
    return dp // shard, shard


def grad_accum_for(global_batch: int, mbs: int, dp: int, src: str) -> int:
    """Micro-batches per step that make mbs * ga * dp the model's global batch."""
    if global_batch % (mbs * dp):
        raise SpecError(f"the model's global batch {global_batch} is not a multiple of mbs*dp = {mbs}*{dp}; "
                        "pass grad_accum", source=src, field="grad_accum")
    return global_batch // (mbs * dp)
