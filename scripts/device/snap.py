#!/usr/bin/env python3
"""Device side: run_bg.sh's incremental snapshots of a run (stdlib only; unsnap.py applies them).

    python3 scripts/device/snap.py make RUNS NAME OUT            snapshot N+1 of RUNS/NAME into OUT
    python3 scripts/device/snap.py resend RUNS NAME OUT FIRST [N]  its parts FIRST.. into OUT again
                                                                 (N: the last snapshot)

A snapshot carries what RUNS/NAME (every file, recursively) and RUNS/NAME.log recorded since the
previous one: a file that only grew goes as its new bytes with their offset (bistat appends to its
JSONL tables and never rewrites them), any other changed file goes whole (new, shrunk, rewritten:
run.json, a finished engine log), a vanished one as deleted. "Only grew" is exact, not a guess:
each changed file is read once, and the sha256 of its first SENT bytes must equal the sha256 of
the whole file as last sent (its state); the same read gives the sha256 of the file as it is now,
which the manifest records (reading costs about 0.1 s per 200 MB). A file with the size, mtime
and inode it was sent with is not read again.

One snapshot is one tar, gzip -1 (zlib level 1, one thread: on 50 MB of a real responses.jsonl
0.2-0.3 s for 10.9 MB, against xz -0's 1.0 s for 9.0 MB), holding data/<path> members and
manifest.json last, split into SNAP_PART_BYTES (15 MiB) parts NAME.snap-SSS.tgz.PP with
NAME.snap-SSS.tgz.sha256 (the archive's and each part's sha256). The parts of every snapshot stay
in RUNS/NAME.snapshots/SSS/ (all of them together are about the run, compressed once), so that
`resend` can copy any of them again. A call brings back at most 8 files and 64 MiB in all, so
OUT gets the .sha256 file and the first PER_CALL (4) parts.

Order, so that a snapshot cut short never makes the next one skip data: the parts are written
under tmp-SSS/, renamed to SSS/, then the state (RUNS/NAME.snapshots/state.json, by os.replace)
advances, then OUT gets its copies. A snapshot killed before the state advanced is made again,
with the same number, by the next call.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import time
import uuid

PART_BYTES = int(os.environ.get("SNAP_PART_BYTES", 15 * 1024 * 1024))
PER_CALL = 4               # parts copied into OUT per call: 4 x 15 MiB + the .sha256 < 64 MiB
CHUNK = 1 << 20
STATE_SCHEMA = "bistat.snapshot-state/1"
MANIFEST_SCHEMA = "bistat.snapshot/1"


def snap_dir(runs: str, name: str) -> str:
    return os.path.join(runs, f"{name}.snapshots")


def archive_name(name: str, seq: int) -> str:
    return f"{name}.snap-{seq:03d}.tgz"


def load_state(sdir: str, name: str) -> dict:
    try:
        with open(os.path.join(sdir, "state.json")) as fh:
            state = json.load(fh)
    except FileNotFoundError:
        return {"schema": STATE_SCHEMA, "run": name, "series": uuid.uuid4().hex, "snapshot": 0,
                "files": {}}
    if state.get("schema") != STATE_SCHEMA or state.get("run") != name:
        raise SystemExit(f"snap: {sdir}/state.json is not {name}'s snapshot state")
    return state


def recorded_files(runs: str, name: str) -> list[str]:
    """Paths (relative to RUNS) of the regular files of RUNS/NAME, recursively, and NAME.log."""
    out = []
    for root, dirs, files in os.walk(os.path.join(runs, name)):
        dirs.sort()
        for f in sorted(files):
            full = os.path.join(root, f)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, runs))
    if os.path.isfile(os.path.join(runs, f"{name}.log")):
        out.append(f"{name}.log")
    return out


class _Reader(io.RawIOBase):
    """Exactly ``length`` bytes of ``fh`` from where it stands, each one also fed to ``digest``;
    a file that shrank while it was read raises (the snapshot fails and the next call retries)."""

    def __init__(self, fh, length: int, digest, path: str):
        self.fh, self.left, self.digest, self.path = fh, length, digest, path

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.fh.read(n)
        if len(data) != n:
            raise OSError(f"{self.path} shrank while it was read")
        self.left -= n
        self.digest.update(data)
        return data


def _hash_prefix(fh, length: int, path: str):
    digest = hashlib.sha256()
    left = length
    while left:
        data = fh.read(min(CHUNK, left))
        if not data:
            raise OSError(f"{path} shrank while it was read")
        digest.update(data)
        left -= len(data)
    return digest


def _add(tar: tarfile.TarFile, member: str, fh, length: int, digest, path: str) -> None:
    info = tarfile.TarInfo(member)
    info.size, info.mtime, info.mode = length, int(time.time()), 0o644
    tar.addfile(info, _Reader(fh, length, digest, path))


def write_archive(runs: str, name: str, state: dict, seq: int, path: str) -> tuple[dict, dict]:
    """Write snapshot ``seq`` to ``path`` (a .tgz); return its manifest and the files' next
    state."""
    old = state["files"]
    new_files: dict[str, dict] = {}
    entries = []
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for rel in recorded_files(runs, name):
            full = os.path.join(runs, rel)
            try:
                fh = open(full, "rb")
            except FileNotFoundError:                    # gone since the listing: deleted
                continue
            st = os.fstat(fh.fileno())
            prev = old.get(rel)
            size = st.st_size
            ident = {"size": size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
            if prev and all(prev[k] == v for k, v in ident.items()):   # as sent: not read again
                fh.close()
                entries.append({"path": rel, "mode": "append", "offset": size, "length": 0,
                                "size": size, "sha256": prev["sha256"]})
                new_files[rel] = prev
                continue
            with fh:
                offset = 0
                digest = hashlib.sha256()
                if prev and 0 < prev["size"] <= size:
                    digest = _hash_prefix(fh, prev["size"], rel)
                    if digest.hexdigest() == prev["sha256"]:
                        offset = prev["size"]
                    else:                                # rewritten: whole, from a fresh read
                        fh.seek(0)
                        digest = hashlib.sha256()
                if size > offset or not offset:          # an empty file, whole, too
                    _add(tar, f"data/{rel}", fh, size - offset, digest, rel)
            sha = digest.hexdigest()
            entries.append({"path": rel, "mode": "append" if offset else "whole",
                            "offset": offset, "length": size - offset, "size": size,
                            "sha256": sha})
            new_files[rel] = {**ident, "sha256": sha}
        for rel in sorted(set(old) - set(new_files)):
            entries.append({"path": rel, "mode": "deleted"})
        passes = os.path.join(runs, name, "passes.jsonl")
        n_passes = 0
        if os.path.isfile(passes):
            with open(passes, "rb") as fh:
                n_passes = sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(CHUNK), b""))
        manifest = {"schema": MANIFEST_SCHEMA, "run": name, "series": state["series"],
                    "snapshot": seq, "previous": seq - 1,
                    "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "files": entries,
                    "new_bytes": sum(e.get("length", 0) for e in entries),
                    "recorded_bytes": sum(e.get("size", 0) for e in entries),
                    "passes": n_passes}
        blob = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size, info.mtime, info.mode = len(blob), int(time.time()), 0o644
        tar.addfile(info, io.BytesIO(blob))
    return manifest, new_files


def split(path: str, part_bytes: int) -> list[str]:
    """Split ``path`` into ``path.00``, ``path.01``...; write ``path.sha256``; remove ``path``."""
    parts, lines = [], []
    whole = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            data = fh.read(part_bytes)
            if not data and parts:
                break
            part = f"{path}.{len(parts):02d}"
            with open(part, "wb") as out:
                out.write(data)
            whole.update(data)
            lines.append(f"{hashlib.sha256(data).hexdigest()}  {os.path.basename(part)}\n")
            parts.append(part)
            if len(data) < part_bytes:
                break
    with open(f"{path}.sha256", "w") as fh:
        fh.write(f"{whole.hexdigest()}  {os.path.basename(path)}\n" + "".join(lines))
    os.remove(path)
    return parts


def copy_out(sdir: str, name: str, seq: int, out: str, first: int) -> tuple[int, int]:
    """Copy the .sha256 and parts FIRST.. (at most PER_CALL) of snapshot ``seq`` into OUT;
    return (parts copied, parts in all)."""
    src = os.path.join(sdir, f"{seq:03d}")
    base = archive_name(name, seq)
    n = len([f for f in os.listdir(src)
             if f.startswith(base + ".") and f[len(base) + 1:].isdigit()])
    os.makedirs(out, exist_ok=True)
    shutil.copyfile(os.path.join(src, base + ".sha256"), os.path.join(out, base + ".sha256"))
    copied = 0
    for i in range(first, min(first + PER_CALL, n)):
        shutil.copyfile(os.path.join(src, f"{base}.{i:02d}"), os.path.join(out, f"{base}.{i:02d}"))
        copied += 1
    return copied, n


def make(runs: str, name: str, out: str) -> int:
    sdir = snap_dir(runs, name)
    os.makedirs(sdir, exist_ok=True)
    with open(os.path.join(sdir, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = load_state(sdir, name)
        seq = state["snapshot"] + 1
        for f in os.listdir(sdir):                       # what a snapshot cut short left
            if f.startswith("tmp-") or f == f"{seq:03d}":
                shutil.rmtree(os.path.join(sdir, f))
        tmp = os.path.join(sdir, f"tmp-{seq:03d}")
        os.mkdir(tmp)
        manifest, files = write_archive(runs, name, state, seq,
                                        os.path.join(tmp, archive_name(name, seq)))
        parts = split(os.path.join(tmp, archive_name(name, seq)), PART_BYTES)
        size = sum(os.path.getsize(p) for p in parts)
        os.rename(tmp, os.path.join(sdir, f"{seq:03d}"))
        if os.environ.get("SNAP_TEST_DIE_BEFORE_STATE") == "1":   # tests: killed at the worst time
            os._exit(9)
        state.update(snapshot=seq, files=files)
        with open(os.path.join(sdir, "state.json.tmp"), "w") as fh:
            json.dump(state, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(os.path.join(sdir, "state.json.tmp"), os.path.join(sdir, "state.json"))
    copied, n = copy_out(sdir, name, seq, out, 0)
    kib = -(-size // 1024)
    print(f"[bg] snapshot {seq}: $OUT/{archive_name(name, seq)}.* ({n} part(s), {kib} KiB;"
          f" new bytes {manifest['new_bytes']} of {manifest['recorded_bytes']} recorded;"
          f" {manifest['passes']} passes recorded)")
    if n > copied:
        print(f"[bg] snapshot {seq} has {n} parts; a call brings back {PER_CALL} (8 files, 64 MiB):"
              f" $OUT has parts 00-{copied - 1:02d}; get the rest, {PER_CALL} a call, with: bash"
              f" scripts/device/run_bg.sh --resend {name} {copied} {seq}")
    return 0


def resend(runs: str, name: str, out: str, first: int, seq: int | None) -> int:
    sdir = snap_dir(runs, name)
    if seq is None:
        seq = load_state(sdir, name)["snapshot"]
    if not os.path.isdir(os.path.join(sdir, f"{seq:03d}")):
        print(f"[bg] no snapshot {seq} of {name} in {sdir}")
        return 1
    copied, n = copy_out(sdir, name, seq, out, first)
    if not copied:
        print(f"[bg] snapshot {seq} of {name} has {n} part(s), 00-{n - 1:02d}; none from {first}")
        return 1
    last = first + copied - 1
    print(f"[bg] snapshot {seq} of {name}: $OUT has parts {first:02d}-{last:02d} of {n} and its"
          f" .sha256" + (f"; next: bash scripts/device/run_bg.sh --resend {name} {last + 1} {seq}"
                         if last + 1 < n else ""))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "make":
        return make(*argv[1:])
    if len(argv) in (5, 6) and argv[0] == "resend":
        return resend(argv[1], argv[2], argv[3], int(argv[4]),
                      int(argv[5]) if len(argv) == 6 else None)
    print(__doc__.split("\n\n")[0], file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (OSError, ValueError, KeyError, tarfile.TarError) as exc:
        print(f"snap: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
