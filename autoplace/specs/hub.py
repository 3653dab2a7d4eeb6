"""Hugging Face Hub ids as model arguments: ``autoplace solve Qwen/Qwen3-8B cluster.yaml``.

An argument that is not an existing file but looks like ``ORG/NAME`` is read from the local
Hugging Face cache, the layout huggingface_hub writes (``models--ORG--NAME/refs/main`` holds a
commit, ``snapshots/<commit>/config.json`` the file), without any network.  When the cache has
no copy, huggingface_hub (if installed, and unless ``HF_HUB_OFFLINE`` is set) downloads
config.json alone -- never weights -- for at most a few seconds.  Without either, one line
says how to get it (``hf download``: huggingface_hub 1.x and later install ``hf``, not
``huggingface-cli``).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from autoplace.errors import SpecError

log = logging.getLogger("autoplace")

# ORG/NAME[@REVISION]: the Hub's own rule for names (letters, digits, '-', '_', '.'), one slash.
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w.-]+))?$")
# A file the user meant (a typo in a path) is not a Hub id.
_FILE_SUFFIXES = (".json", ".yaml", ".yml", ".toml")


def hub_cache() -> Path:
    """The hub cache directory, as huggingface_hub resolves it: HF_HUB_CACHE, else HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def parse_repo_id(arg: str) -> tuple[str, str] | None:
    """(repo id, revision) when ``arg`` reads as a Hub model id, else None."""
    match = _REPO_ID.match(arg)
    if match is None or arg.lower().endswith(_FILE_SUFFIXES):
        return None
    return match["repo"], match["rev"] or "main"


def cached_config(repo: str, revision: str = "main", cache: Path | None = None) -> Path | None:
    """config.json of ``repo`` at ``revision`` (a branch, tag or commit) in the cache, or None."""
    root = (cache or hub_cache()) / f"models--{repo.replace('/', '--')}"
    ref = root / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    config = root / "snapshots" / commit / "config.json"
    return config if config.is_file() else None


DOWNLOAD_SECONDS = 5.0  # how long a cache miss may wait on the Hub before the one-line error


def _download(repo: str, revision: str, seconds: float = DOWNLOAD_SECONDS) -> Path | None:
    """config.json through huggingface_hub, or None when it is missing, offline, fails or takes
    longer than ``seconds``.

    With no network huggingface_hub retries with backoff (five retries, ~26 s) and logs a line
    for each attempt; the download runs in a daemon thread that is given up on after
    ``seconds``, with the library's logger quiet, so a miss costs a few seconds and one line.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return None
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None
    found: list[Path] = []

    def fetch() -> None:
        try:
            found.append(Path(hf_hub_download(repo, "config.json", revision=revision)))
        except Exception as exc:  # noqa: BLE001 - no network, gated repo, no such repo: all mean "not here"
            log.info("could not download config.json of %s: %s", repo, exc)

    hub_log = logging.getLogger("huggingface_hub")
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # its retry warnings, one per attempt
    worker = threading.Thread(target=fetch, name="autoplace-hub-download", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():  # still retrying: left to end with the process, its warnings kept quiet
        log.info("gave up downloading config.json of %s after %.0f s", repo, seconds)
    else:
        hub_log.setLevel(level)
    return found[0] if found else None


def resolve_model(arg: str | Path) -> tuple[Path, str | None]:
    """The file to read for a model argument, and the Hub id when it was one.

    Args:
        arg: a path to model.json / config.json, or ``ORG/NAME[@REVISION]``.

    Returns:
        (path, repo id or None).  An existing file always wins over a Hub id.

    Raises:
        SpecError: a Hub id with no config.json in the cache and none downloadable.
    """
    path = Path(arg)
    parsed = parse_repo_id(str(arg))
    if path.exists() or parsed is None:
        return path, None
    repo, revision = parsed
    found = cached_config(repo, revision) or _download(repo, revision)
    if found is None:
        rev = "" if revision == "main" else f" --revision {revision}"
        raise SpecError(
            f"not a file, and the Hugging Face cache ({hub_cache()}) has no config.json for {repo}@{revision} "
            f"(nor could it be downloaded); get it with `hf download {repo} config.json{rev}` "
            "(pip install huggingface_hub) or pass the path of its config.json", source=str(arg))
    return found, repo
