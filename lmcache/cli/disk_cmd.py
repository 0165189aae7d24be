"""``lmcache disk inspect DIR`` and ``lmcache disk verify DIR [--delete-corrupt]``.

DIR is the ``local_disk`` path of a config (holding one sub-directory per cache:
``kv``, ``ec``, ...) or one of those sub-directories. Both commands only read entry
files (``*.lmc``); ``verify --delete-corrupt`` deletes the ones that fail, exactly
as the disk tier itself would on reading them. Safe to run next to a live server:
entries appear by atomic rename, temp files are ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

from lmcache.cli.progress import Progress


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("disk", help="inspect or verify a disk cache directory", description="Disk-tier tools.")
    dsub = p.add_subparsers(dest="disk_cmd", metavar="COMMAND", required=True)
    ins = dsub.add_parser(
        "inspect",
        help="entries, bytes and namespaces (model, KV dtype, layout) of a disk cache directory",
        description="Count entries and bytes per namespace (model, world size, KV dtype, memory layout), "
        "reading entry headers only.",
    )
    ins.add_argument("dir", help="local_disk directory (or one cache sub-directory such as DIR/kv)")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ins.set_defaults(func=run_inspect)
    ver = dsub.add_parser(
        "verify",
        help="read every entry and check its header and payload checksum",
        description="Read every entry file and verify its header (magic, version, key, size) and payload "
        "checksum. Exit 0 if all are good, 1 if any is corrupt.",
    )
    ver.add_argument("dir", help="local_disk directory (or one cache sub-directory such as DIR/kv)")
    ver.add_argument("--delete-corrupt", action="store_true", help="delete entries that fail verification")
    ver.set_defaults(func=run_verify)


def entry_files(root: str) -> list[tuple[str, str]]:
    """``(cache, path)`` of every entry file under ``root`` (one level of cache sub-directories)."""
    from lmcache.v1.storage_backend.disk_file import ENTRY_NAME_LEN, ENTRY_SUFFIX

    def scan(directory: str, cache: str) -> list[tuple[str, str]]:
        out = []
        with os.scandir(directory) as it:
            for de in it:
                named = de.name.endswith(ENTRY_SUFFIX) and len(de.name) == ENTRY_NAME_LEN
                if named and de.is_file(follow_symlinks=False):
                    out.append((cache, de.path))
        return out

    found = scan(root, os.path.basename(os.path.normpath(root)))
    with os.scandir(root) as it:
        subdirs = sorted(de.path for de in it if de.is_dir(follow_symlinks=False) and not de.name.startswith("."))
    for sub in subdirs:
        found += scan(sub, os.path.basename(sub))
    return sorted(found)


def _check_dir(path: str) -> str | None:
    if not os.path.isdir(path):
        return f"lmcache: {path!r} is not a directory (expected a local_disk cache directory)"
    return None


@dataclass
class _Group:
    entries: int = 0
    bytes: int = 0
    shapes: set[tuple[int, ...]] = field(default_factory=set)


def run_inspect(args: argparse.Namespace) -> int:
    from lmcache.v1.keys import parse_cache_key
    from lmcache.v1.storage_backend.disk_file import read_header
    from lmcache.v1.storage_backend.entry_format import CorruptEntryError

    if (err := _check_dir(args.dir)) is not None:
        print(err, file=sys.stderr)
        return 2
    files = entry_files(args.dir)
    groups: dict[tuple[str, str, int, str, str], _Group] = defaultdict(_Group)
    bad = 0
    progress = Progress(len(files), "headers")
    for cache, path in files:
        progress.advance()
        try:
            header, st = read_header(path)
            key = parse_cache_key(header.key)
        except FileNotFoundError:
            continue  # evicted meanwhile
        except (CorruptEntryError, ValueError, OSError):
            bad += 1
            continue
        dtype = key.dtype if isinstance(key.dtype, str) else str(key.dtype).removeprefix("torch.")
        g = groups[(cache, key.model_name, key.world_size, dtype, header.meta.fmt.name)]
        g.entries += 1
        g.bytes += st.st_size
        g.shapes.add(tuple(header.meta.shape))
    progress.done()
    rows = [
        {
            "cache": cache,
            "model": model,
            "world_size": world,
            "kv_dtype": dtype,
            "layout": fmt,
            "entries": g.entries,
            "bytes": g.bytes,
            "chunk_shapes": sorted(list(s) for s in g.shapes)[:4],
        }
        for (cache, model, world, dtype, fmt), g in sorted(groups.items())
    ]
    total = {"entries": sum(r["entries"] for r in rows), "bytes": sum(r["bytes"] for r in rows), "unreadable": bad}
    if args.json:
        print(json.dumps({"directory": args.dir, "namespaces": rows, "total": total}, indent=2))
        return 0
    print(f"{args.dir}: {total['entries']} entries, {_human(total['bytes'])}, {bad} unreadable headers")
    for r in rows:
        print(
            f"  [{r['cache']}] model={r['model']} world_size={r['world_size']} kv_dtype={r['kv_dtype']} "
            f"layout={r['layout']}: {r['entries']} entries, {_human(r['bytes'])}"
        )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    import torch

    from lmcache.v1.storage_backend.disk_file import entry_file_name, read_entry, read_header, remove_quiet
    from lmcache.v1.storage_backend.entry_format import CorruptEntryError

    if (err := _check_dir(args.dir)) is not None:
        print(err, file=sys.stderr)
        return 2
    files = entry_files(args.dir)
    good = corrupt = deleted = vanished = 0
    progress = Progress(len(files), "entries verified")
    for _, path in files:
        progress.advance()
        try:
            header, _ = read_header(path)
            if entry_file_name(header.key) != os.path.basename(path):
                raise CorruptEntryError(f"file holds key {header.key!r}, which has another file name")
            out = torch.empty(header.payload_len, dtype=torch.uint8)
            read_entry(path, header.key, header.header_len, out, o_direct=False)
            good += 1
            continue
        except FileNotFoundError:
            vanished += 1
            continue
        except (CorruptEntryError, ValueError, OSError) as exc:
            reason = str(exc)
        corrupt += 1
        action = ""
        if args.delete_corrupt:
            deleted += remove_quiet(path)
            action = " (deleted)"
        print(f"CORRUPT {path}: {reason}{action}")
    progress.done()
    print(f"{args.dir}: {good} good, {corrupt} corrupt, {deleted} deleted, {vanished} vanished during the check")
    return 1 if corrupt else 0


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"
