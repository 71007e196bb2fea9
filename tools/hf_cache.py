"""Hub-style model ids (`HuggingFaceTB/SmolLM2-135M-Instruct`) resolved from the local Hugging Face cache.

We never download from the Hub; we read what `huggingface_hub` already put on disk. Its layout:
    <cache>/models--<org>--<name>/refs/main              the commit hash `main` pointed to when last fetched
    <cache>/models--<org>--<name>/snapshots/<hash>/...    the files of that commit (symlinks into blobs/)
where <cache> is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (huggingface_hub's order).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from refimpl.errors import CheckpointError

# org/name as the Hub spells them: letters, digits, '-', '_', '.'; no leading dot, no '..'
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface") / "hub"


def looks_like_repo_id(text: str) -> bool:
    return bool(_REPO_ID.match(text)) and ".." not in text


def resolve_repo_id(repo_id: str, revision: str = "main") -> Path:
    """The snapshot directory of `repo_id` at `revision` (a ref name or a commit hash) in the local HF cache."""
    cache = hub_cache_dir()
    org, name = repo_id.split("/")
    repo = cache / f"models--{org}--{name}"
    hint = f"download it first (`hf download {repo_id}`) or pass a local directory or .gguf"
    if not repo.is_dir():
        raise CheckpointError(f"{repo_id}: not a local path, and not in the Hugging Face cache {cache} (HF_HOME / "
                              f"HF_HUB_CACHE); {hint}")
    ref = repo / "refs" / revision
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if not re.fullmatch(r"[0-9a-f]{40}", commit) or not snapshot.is_dir():
        found = sorted(p.name for p in (repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        if len(found) == 1 and not ref.is_file():  # a cache filled by hand or by an offline copy: one snapshot
            return repo / "snapshots" / found[0]
        raise CheckpointError(f"{repo_id}: the Hugging Face cache {repo} has no snapshot for {revision!r} "
                              f"(snapshots: {', '.join(found) or 'none'}); {hint}")
    if not (snapshot / "config.json").is_file():
        raise CheckpointError(f"{repo_id}: the cached snapshot {snapshot} has no config.json (a partial download?); "
                              f"{hint}")
    return snapshot
