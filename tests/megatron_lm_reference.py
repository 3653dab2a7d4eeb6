"""Megatron-LM's own argument code, from a checkout, for the tests that hold autoplace's restatements to it.

Run in a process of its own (it puts Megatron-LM's training package on sys.path)::

    python tests/megatron_lm_reference.py CHECKOUT flags            -> the flag table read off its parser
    python tests/megatron_lm_reference.py CHECKOUT validate CASES   -> per case: its args or its error

CASES is a JSON file: [{"words": [...], "world": N, "env": {...}, "arch": 9}, ...].  Each case runs
Megatron-LM core_v0.16.1's parse_args (on the words) and validate_args with pretrain_gpt.py's
defaults; the answer is {"args": {name: repr(value)}} or {"error": "Type: message"}.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")  # a bare clone, where this machine keeps one
TAG = "core_v0.16.1"


def checkout(scratch: Path) -> Path | None:
    """A Megatron-LM core_v0.16.1 tree: $MEGATRON_LM, else the bare mirror's tag unpacked into ``scratch``."""
    given = os.environ.get("MEGATRON_LM")
    if given:
        return Path(given)
    if not MIRROR.is_dir():
        return None
    archive = subprocess.run(["git", "-C", str(MIRROR), "archive", TAG, "megatron/training", "megatron/legacy",
                              "megatron/post_training"], capture_output=True, check=False)
    if archive.returncode != 0:
        return None
    subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive.stdout, check=True)
    return scratch


def run(tree: Path, *argv: str) -> Any:
    """This script's answer for ``argv`` against the Megatron-LM tree ``tree``."""
    done = subprocess.run([sys.executable, __file__, str(tree), *argv], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    return json.loads(done.stdout.splitlines()[-1])


def _validate(case: dict[str, Any]) -> dict[str, Any]:
    import megatron.training.arguments as arguments

    from autoplace.frameworks._megatron_flags import parse_words

    old = dict(os.environ)
    os.environ.update(case.get("env", {}))
    try:
        args = parse_words(case["words"])  # the same namespace as its parser's (held to it by the flags test)
        args.rank, args.world_size = 0, case["world"]
        with mock.patch.object(arguments, "get_device_arch_version", lambda: case.get("arch", 9)), \
                contextlib.redirect_stdout(io.StringIO()):
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    except BaseException as exc:  # noqa: BLE001 - its refusal is the answer
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.environ.clear()
        os.environ.update(old)
    return {"args": {k: repr(v) for k, v in vars(args).items()}}


def main(argv: list[str]) -> None:
    import warnings

    warnings.simplefilter("ignore")
    from autoplace.frameworks._megatron_flags import read_parser

    tree, what = Path(argv[0]), argv[1]
    with contextlib.redirect_stdout(io.StringIO()):
        table = read_parser(tree)
    if what == "flags":
        print(json.dumps(table))
    else:
        print(json.dumps([_validate(case) for case in json.loads(Path(argv[2]).read_text())]))


if __name__ == "__main__":
    main(sys.argv[1:])
