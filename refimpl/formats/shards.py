"""Which safetensors file holds each tensor of an HF model directory: one file, or the shards an index names.

The index (model.safetensors.index.json) is a stranger's file, so its shard names are checked as names: relative,
no `..`, no NUL, inside the model directory. The files they name may be symlinks, as in the Hugging Face cache
(snapshots/<rev>/model-00001-of-00002.safetensors -> ../../blobs/<sha256>): a link is followed wherever it leads,
as long as it ends at a regular file. Every tensor must live in exactly one shard: a name listed twice in the
index, or present in two shards, is ambiguous (which copy HF would load depends on file order), so it is refused.
"""
from __future__ import annotations

import stat
from pathlib import Path, PurePosixPath

from refimpl.errors import CheckpointError, quote
from refimpl.formats.jsonfile import read_json_object
from refimpl.formats.safe_open import check_path, file_kind, regular_file, stat_path
from refimpl.formats.safetensors_io import SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def shard_path(model_dir: Path, shard, index: Path) -> Path:
    """The file an index entry names, refusing names that are absolute or leave the model directory."""
    if not isinstance(shard, str) or not shard:
        raise CheckpointError(f"{index}: weight_map values must be shard file names, got {quote(shard)}")
    name = check_path(shard, f"{index}: shard name")
    parts = PurePosixPath(shard.replace("\\", "/")).parts
    if name.is_absolute() or shard.startswith(("/", "\\")) or ".." in parts or (parts and ":" in parts[0]):
        raise CheckpointError(f"{index}: names shard {quote(shard)}, but a shard must be a file inside "
                              f"{model_dir} (no absolute path, no '..')")
    path = model_dir / shard
    st = stat_path(path, f"a shard named in {index.name}")
    if st is None or not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{index}: names shard {quote(shard)}, which is not a file in {model_dir}"
                              f"{'' if st is None else f' (it is {file_kind(st.st_mode)})'}")
    return path


def weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it (one file, or the shards an index names)."""
    single, index = model_dir / SINGLE, model_dir / INDEX
    if stat_path(index) is not None:
        weight_map = read_json_object(index, "a safetensors index with a weight_map").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in
                                                                         weight_map.values()):
            raise CheckpointError(f"{index}: expected a 'weight_map' object of tensor name -> shard file")
        shards = {shard: shard_path(model_dir, shard, index) for shard in dict.fromkeys(weight_map.values())}
        return {name: shards[shard] for name, shard in weight_map.items()}
    if stat_path(single) is not None:
        return {name: single for name in SafetensorsFile(regular_file(single)).names()}
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    hint = f" (found {', '.join(found)} without an index)" if found else ""
    if not found and any(model_dir.glob("pytorch_model*.bin")):
        hint = " (pytorch_model.bin is a pickle, which llama32 never loads: re-save with safe_serialization)"
    raise CheckpointError(f"{model_dir}: no {SINGLE} or {INDEX}{hint}")


def open_shards(model_dir: Path) -> tuple[dict[str, Path], dict[Path, SafetensorsFile]]:
    """(tensor name -> file, file -> its parsed header), each tensor found in exactly the file the index names."""
    where = weight_files(model_dir)
    files = {path: SafetensorsFile(path) for path in dict.fromkeys(where.values())}
    index = model_dir / INDEX
    for name, path in where.items():
        if name not in files[path].tensors:
            raise CheckpointError(f"{index}: tensor {quote(name)} is listed in {path.name}, which does not "
                                  f"contain it")
    if len(files) > 1:
        holders: dict[str, list[Path]] = {}
        for path, st in files.items():
            for name in st.tensors:
                holders.setdefault(name, []).append(path)
        twice = next((n for n, paths in holders.items() if len(paths) > 1), None)
        if twice is not None:
            raise CheckpointError(f"{index}: tensor {quote(twice)} is stored in more than one shard "
                                  f"({', '.join(p.name for p in holders[twice])}); each tensor must be in one")
    return where, files


def read_headers(model_dir: Path) -> tuple[dict[str, SafetensorsFile], dict[str, tuple[int, ...]]]:
    """({tensor name: the opened file holding it}, {tensor name: shape}) from the headers alone."""
    where, files = open_shards(model_dir)
    holder = {name: files[path] for name, path in where.items()}
    return holder, {name: st.tensors[name].shape for name, st in holder.items()}
