"""Per-file SHA-256 checksums of a checkpoint: written before it is published, verified on load.

A checkpoint directory `iter_N/` holds DCP's data files (`__<rank>_<k>.distcp`), its `.metadata`, and
`checksums.json`:

    {"algorithm": "sha256", "files": {".metadata": {"bytes": 1234, "sha256": "ab12..."}, ...}}

The manifest is written into `iter_N.partial/` after every rank has written its files and before rank 0
renames the directory to `iter_N/`, so a published checkpoint always has one (checkpoints written before
this existed have none: they load unverified, with a note). The hashing is shared: rank r hashes the
files at positions r, r + world, ... of the sorted file list, rank 0 gathers the digests and writes the
manifest; loading verifies the same way, and the ranks agree on the outcome, so a flipped byte anywhere
fails every rank with one line naming the file.

Cost: one extra read of the checkpoint at save (from the page cache: the files were just written) and at
load, at SHA-256 speed (~0.5-2 GB/s per core), divided over the ranks. `--no-verify-checkpoint` skips
the check at load (the manifest is always written); bench/micro/checkpoint_checksums.py measures it.
`tools/checkpoint_convert.py verify CKPT` checks a checkpoint offline.
"""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST = "checksums.json"
_CHUNK = 8 << 20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def _files(path: str) -> list[str]:
    """The checkpoint's files (relative paths), the manifest and temporary files excluded."""
    out = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def _share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def hash_share(path: str, rank: int = 0, world: int = 1) -> dict:
    """{relative path: {"bytes", "sha256"}} of this rank's share of the files under `path`."""
    return {rel: {"bytes": os.path.getsize(os.path.join(path, rel)), "sha256": sha256_file(os.path.join(path, rel))}
            for rel in _share(_files(path), rank, world)}


def write_manifest(path: str, digests: dict) -> None:
    """Write `checksums.json` (via a temp file and fsync: it is published with the directory)."""
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": "sha256", "files": dict(sorted(digests.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))


def read_manifest(path: str) -> dict | None:
    """The manifest's {file: {"bytes", "sha256"}}, None when the checkpoint has none; ValueError naming
    the manifest when it is unreadable."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        return None
    try:
        with open(manifest) as f:
            data = json.load(f)
        files = data["files"]
        if data.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("unknown layout")
        return files
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{manifest} is corrupt ({type(e).__name__}: {e})") from None


def verify_share(path: str, rank: int = 0, world: int = 1) -> str | None:
    """Check this rank's share of the manifest's files: the first problem as one line naming the file,
    or None (also when the checkpoint has no manifest: see `has_manifest`)."""
    try:
        files = read_manifest(path)
    except ValueError as e:
        return str(e)
    if files is None:
        return None
    for rel in _share(sorted(files), rank, world):
        f = os.path.join(path, rel)
        want = files[rel]
        if not os.path.isfile(f):
            return f"{f} is missing (listed in {MANIFEST})"
        size = os.path.getsize(f)
        if size != want.get("bytes"):
            return f"{f} is corrupt: {size} bytes, {MANIFEST} says {want.get('bytes')}"
        try:
            digest = sha256_file(f)
        except OSError as e:
            return f"{f} cannot be read ([Errno {e.errno}] {e.strerror})"
        if digest != want.get("sha256"):
            return (f"{f} is corrupt: its SHA-256 differs from the one in {MANIFEST} written at save "
                    f"(use --no-verify-checkpoint to load it anyway)")
    return None


def has_manifest(path: str) -> bool:
    return os.path.exists(os.path.join(path, MANIFEST))


def checksum_checkpoint(path: str, rank: int = 0, world: int = 1) -> None:
    """Collective (over `world` ranks when > 1): hash every file of the written checkpoint `path` (each
    rank its share) and write the manifest on rank 0."""
    try:
        mine = hash_share(path, rank, world)
    except OSError as e:  # still take part in the gather, or the other ranks would wait in it forever
        mine = e
    shares = _gather(mine, world)
    if isinstance(mine, OSError):
        raise mine
    if any(isinstance(share, OSError) for share in shares):
        return  # the failing rank raises; the caller's agreement stops every rank
    if rank == 0:
        digests = {}
        for share in shares:
            digests.update(share)
        write_manifest(path, digests)


def verify_checkpoint(path: str) -> str | None:
    """One process: every file of checkpoint `path` against its manifest; the first problem or None.
    A checkpoint without a manifest is a problem here (nothing to verify against)."""
    if not has_manifest(path):
        return f"{path} has no {MANIFEST} (saved before checksums were written): nothing to verify against"
    return verify_share(path)
