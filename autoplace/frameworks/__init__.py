"""The supported training frameworks, one module each, found by name (as ``solvers/`` back ends are).

Each module declares a :class:`~autoplace.frameworks.base.Framework`: what the framework can
express, how it is costed, rendered, read back and launched.  This registry is the one place
that lists them; everything else asks it.

``ANY`` and ``NONE`` are the two search modes that name no single framework: plans at least
one framework can run, and the theoretical optimum, unfiltered.
"""

from __future__ import annotations

from pathlib import Path

from autoplace.errors import SpecError
from autoplace.frameworks.accelerate import Accelerate
from autoplace.frameworks.base import Framework, ReadConfig
from autoplace.frameworks.deepspeed import DeepSpeed
from autoplace.frameworks.fsdp import Fsdp
from autoplace.frameworks.megatron import Megatron
from autoplace.frameworks.torchtitan import Torchtitan
from autoplace.plan import Plan
from autoplace.specs.cluster import ClusterSpec
from autoplace.specs.model import ModelSpec

__all__ = ["ANY", "NONE", "FRAMEWORKS", "Framework", "ReadConfig", "all_frameworks", "check_name", "get", "plan_from_file", "read_config"]

ANY, NONE = "any", "none"

_REGISTRY: dict[str, Framework] = {f.name: f for f in (DeepSpeed(), Megatron(), Torchtitan(), Fsdp(), Accelerate())}
FRAMEWORKS: tuple[str, ...] = tuple(_REGISTRY)


def get(name: str) -> Framework:
    """The framework registered as ``name``.

    Raises:
        SpecError: an unknown name (the message lists the valid ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SpecError(f"unknown framework {name!r}; valid: {', '.join(FRAMEWORKS)}", field="--framework") from None


def all_frameworks() -> list[Framework]:
    """Every registered framework, in the registry's order."""
    return list(_REGISTRY.values())


def check_name(name: str) -> None:
    """A ``--framework`` value: a registered name, ``any`` or ``none``.

    Raises:
        SpecError: anything else, listing the valid values.
    """
    if name not in (*FRAMEWORKS, ANY, NONE):
        raise SpecError(f"unknown framework {name!r}; valid: {', '.join((ANY, NONE, *FRAMEWORKS))}",
                        field="--framework")


def read_config(path: str | Path, model: ModelSpec, cluster: ClusterSpec) -> ReadConfig:
    """Read a framework's config by its suffix (.json DeepSpeed, .yaml/.yml accelerate, .toml
    torchtitan), with the notes a pre-submit check shows.

    Raises:
        SpecError: a suffix no framework reads, or what that framework's reader refuses.
    """
    suffix = Path(path).suffix.lower()
    for framework in _REGISTRY.values():
        if suffix in framework.config_suffixes:
            return framework.read(Path(path), model, cluster)
    kinds = ", ".join(f"a {f.title} {'/'.join(f.config_suffixes)}" for f in _REGISTRY.values() if f.config_suffixes)
    raise SpecError(f"expected {kinds}", source=str(path))


def plan_from_file(path: str | Path, model: ModelSpec, cluster: ClusterSpec) -> Plan:
    """The plan a framework's config runs (:func:`read_config` without its notes)."""
    return read_config(path, model, cluster).plan
