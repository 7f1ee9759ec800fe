#!/usr/bin/env python3
"""Here: rebuild runs from run_bg.sh's incremental snapshots (stdlib only; snap.py makes them).

    python3 scripts/device/unsnap.py DEST FILES_OR_DIRS...

finds every NAME.snap-SSS.tgz.PP and NAME.snap-SSS.tgz.sha256 among the files and (recursively)
the folders given, the folders each call's returned files landed in, and applies the snapshots of
each NAME in order 1, 2, 3... onto DEST/NAME and DEST/NAME.log. It refuses, naming the snapshot
and the file, a snapshot missing from the sequence, a missing part, a part or archive that fails
its sha256, an append whose offset is not the size of the file being rebuilt, and a snapshot of
another series (runs/ wiped on the device and the run started again). Every file's sha256 is
checked against the manifest after each snapshot, and on disk after the last one.

DEST/NAME.unsnap.json records what was applied: running again applies only newer snapshots, so the
same snapshots again onto an up-to-date DEST are a no-op (each is checked to be the one applied).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tarfile
import tempfile

PART_RE = re.compile(r"^(?P<name>.+)\.snap-(?P<seq>\d{3,})\.tgz\.(?P<part>\d{2,})$")
SUM_RE = re.compile(r"^(?P<name>.+)\.snap-(?P<seq>\d{3,})\.tgz\.sha256$")
CHUNK = 1 << 20


class Refused(Exception):
    pass


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def find(args: list[str]) -> dict[str, dict[int, dict]]:
    """{name: {seq: {"sums": [paths], "parts": {index: [paths]}}}} of every snapshot file found."""
    paths = []
    for arg in args:
        if os.path.isdir(arg):
            for root, dirs, files in os.walk(arg):
                dirs.sort()
                paths += [os.path.join(root, f) for f in sorted(files)]
        elif os.path.isfile(arg):
            paths.append(arg)
        else:
            raise Refused(f"{arg}: no such file or folder")
    found: dict[str, dict[int, dict]] = {}
    for path in paths:
        base = os.path.basename(path)
        m = PART_RE.match(base) or SUM_RE.match(base)
        if not m:
            continue
        snap = found.setdefault(m["name"], {}).setdefault(int(m["seq"]), {"sums": [], "parts": {}})
        if "part" in m.groupdict():
            snap["parts"].setdefault(int(m["part"]), []).append(path)
        else:
            snap["sums"].append(path)
    return found


def read_sums(name: str, seq: int, snap: dict) -> tuple[str, list[str]]:
    """The archive's sha256 and each part's, from its .sha256 file(s), which must agree."""
    label = f"{name}.snap-{seq:03d}.tgz.sha256"
    if not snap["sums"]:
        raise Refused(f"{name} snapshot {seq}: {label} is missing (it comes back with every part)")
    texts = {}
    for path in snap["sums"]:
        with open(path) as fh:
            texts.setdefault(fh.read(), path)
    if len(texts) > 1:
        raise Refused(f"{name} snapshot {seq}: two different {label} ({', '.join(texts.values())}):"
                      f" snapshots of two different runs named {name}? Unsnap them apart")
    lines = [line.split() for line in next(iter(texts)).splitlines() if line.strip()]
    arch = f"{name}.snap-{seq:03d}.tgz"
    if not lines or lines[0][1:] != [arch] or any(
            len(line) != 2 or line[1] != f"{arch}.{i:02d}" for i, line in enumerate(lines[1:])):
        raise Refused(f"{name} snapshot {seq}: {snap['sums'][0]} is not a snapshot's .sha256")
    return lines[0][0], [line[0] for line in lines[1:]]


def assemble(name: str, seq: int, snap: dict, into) -> None:
    """Write snapshot ``seq``'s archive, checked part by part, into the file ``into``."""
    whole, sums = read_sums(name, seq, snap)
    digest = hashlib.sha256()
    for i, want in enumerate(sums):
        label = f"{name}.snap-{seq:03d}.tgz.{i:02d}"
        copies = snap["parts"].get(i, [])
        if not copies:
            raise Refused(f"{name} snapshot {seq}: part {label} is missing ({len(sums)} part(s));"
                          f" on the device:"
                          f" bash scripts/device/run_bg.sh --resend {name} {i} {seq}")
        for path in copies:
            with open(path, "rb") as fh:
                data = fh.read()
            if hashlib.sha256(data).hexdigest() == want:
                break
        else:
            raise Refused(f"{name} snapshot {seq}: part {label} fails its sha256"
                          f" ({', '.join(copies)}); on the device:"
                          f" bash scripts/device/run_bg.sh --resend {name} {i} {seq}")
        digest.update(data)
        into.write(data)
    extra = sorted(set(snap["parts"]) - set(range(len(sums))))
    if extra:
        raise Refused(f"{name} snapshot {seq}: parts {extra} beyond the {len(sums)} its .sha256"
                      f" lists")
    if digest.hexdigest() != whole:
        raise Refused(f"{name} snapshot {seq}: the parts joined fail the archive's sha256")


def safe(name: str, rel: str) -> str:
    parts = rel.split("/")
    if rel.startswith("/") or ".." in parts or not (rel == f"{name}.log" or parts[0] == name
                                                   and len(parts) > 1 and all(parts)):
        raise Refused(f"{name}: manifest path {rel!r} is outside {name}/ and {name}.log")
    return rel


class Rebuild:
    """One run's rebuild in DEST: its record, and a running sha256 of each file it touched."""

    def __init__(self, dest: str, name: str):
        self.dest, self.name = dest, name
        self.record_path = os.path.join(dest, f"{name}.unsnap.json")
        self.hashes: dict[str, "hashlib._Hash"] = {}
        if os.path.exists(self.record_path):
            with open(self.record_path) as fh:
                self.record = json.load(fh)
        else:
            for p in (name, f"{name}.log"):
                if os.path.exists(os.path.join(dest, p)):
                    raise Refused(f"{name}: {os.path.join(dest, p)} exists and unsnap.py did not"
                                  f" build it ({self.record_path} is missing); choose another DEST")
            self.record = {"run": name, "series": None, "snapshot": 0, "archives": {}, "files": {}}

    def _size(self, rel: str) -> int:
        path = os.path.join(self.dest, rel)
        return os.path.getsize(path) if os.path.exists(path) else 0

    def _hash(self, rel: str):
        if rel not in self.hashes:
            path = os.path.join(self.dest, rel)
            digest = hashlib.sha256()
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    for chunk in iter(lambda: fh.read(CHUNK), b""):
                        digest.update(chunk)
            self.hashes[rel] = digest
        return self.hashes[rel]

    def apply(self, seq: int, archive: str, archive_sha: str) -> int:
        """Apply one checked archive; return the bytes written."""
        label = f"{self.name} snapshot {seq}"
        with tarfile.open(archive, "r:gz") as tar:
            members = {m.name: m for m in tar.getmembers()}
            if "manifest.json" not in members:
                raise Refused(f"{label}: the archive holds no manifest.json")
            manifest = json.load(tar.extractfile(members["manifest.json"]))
            if manifest.get("run") != self.name or manifest.get("snapshot") != seq:
                raise Refused(f"{label}: its manifest says run {manifest.get('run')!r} snapshot"
                              f" {manifest.get('snapshot')!r}")
            series = self.record["series"]
            if series is not None and manifest.get("series") != series:
                raise Refused(f"{label}: of another series ({manifest.get('series')}) than the"
                              f" snapshots applied to {self.dest} ({series}): runs/ wiped on the"
                              f" device and the run started again? Unsnap it into another DEST")
            entries = manifest["files"]
            for e in entries:                               # check everything before writing
                rel = safe(self.name, e["path"])
                if e["mode"] == "deleted":
                    continue
                if e["mode"] not in ("append", "whole"):
                    raise Refused(f"{label}: {rel}: unknown mode {e['mode']!r}")
                if e["mode"] == "append" and e["offset"] != self._size(rel):
                    raise Refused(f"{label}: {rel}: appends at offset {e['offset']}, but"
                                  f" {os.path.join(self.dest, rel)} has {self._size(rel)} bytes")
                member = members.get(f"data/{rel}")
                if e["length"] and (member is None or member.size != e["length"]):
                    raise Refused(f"{label}: {rel}: its {e['length']} bytes are not in the archive")
            written = 0
            for e in entries:
                rel, path = e["path"], os.path.join(self.dest, e["path"])
                if e["mode"] == "deleted":
                    if os.path.exists(path):
                        os.remove(path)
                    self.hashes.pop(rel, None)
                    continue
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if e["mode"] == "whole":
                    self.hashes[rel] = hashlib.sha256()
                digest = self._hash(rel)
                src = tar.extractfile(members[f"data/{rel}"]) if e["length"] else None
                if e["mode"] == "whole" or not os.path.exists(path):
                    open(path, "wb").close()
                if src is not None:
                    with open(path, "ab") as out:
                        for chunk in iter(lambda: src.read(CHUNK), b""):
                            digest.update(chunk)
                            out.write(chunk)
                written += e["length"]
                if digest.hexdigest() != e["sha256"]:
                    raise Refused(f"{label}: {path} does not hash as its manifest says after this"
                                  f" snapshot ({digest.hexdigest()} != {e['sha256']})")
        self.record.update(series=manifest["series"], snapshot=seq,
                           files={e["path"]: {"size": e["size"], "sha256": e["sha256"]}
                                  for e in entries if e["mode"] != "deleted"})
        self.record["archives"][str(seq)] = archive_sha
        tmp = self.record_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.record, fh, indent=1)
        os.replace(tmp, self.record_path)
        return written

    def verify_disk(self) -> tuple[int, int]:
        """Every file's sha256 on disk against the last manifest; (files, bytes)."""
        files = self.record["files"]
        for rel, want in files.items():
            path = os.path.join(self.dest, rel)
            if not os.path.isfile(path) or file_sha256(path) != want["sha256"]:
                raise Refused(f"{self.name} snapshot {self.record['snapshot']}: {path} does not"
                              f" match the manifest (sha256 {want['sha256']}) on disk")
        extra = []
        for root, _, names in os.walk(os.path.join(self.dest, self.name)):
            extra += [os.path.relpath(os.path.join(root, f), self.dest) for f in names]
        extra = sorted(set(extra) - set(files))
        if extra:
            print(f"unsnap: {self.name}: note: {len(extra)} file(s) in {self.dest} the run does not"
                  f" hold (left as they are): {', '.join(extra[:5])}")
        return len(files), sum(f["size"] for f in files.values())


def unsnap(dest: str, name: str, snaps: dict[int, dict]) -> None:
    os.makedirs(dest, exist_ok=True)
    rb = Rebuild(dest, name)
    last = rb.record["snapshot"]
    for seq in sorted(s for s in snaps if s <= last):           # already applied: the same ones?
        if not snaps[seq]["sums"]:
            continue
        whole, _ = read_sums(name, seq, snaps[seq])
        if rb.record["archives"].get(str(seq)) != whole:
            raise Refused(f"{name} snapshot {seq}: {snaps[seq]['sums'][0]} is not the snapshot"
                          f" {seq} applied to {dest} (sha256 {whole})")
    newer = sorted(s for s in snaps if s > last)
    for want, seq in enumerate(newer, start=last + 1):
        if seq != want:
            raise Refused(f"{name} snapshot {want} is missing (found {sorted(snaps)}, {dest} holds"
                          f" {last}): fetch {name}.snap-{want:03d}.tgz.* (on the device: bash"
                          f" scripts/device/run_bg.sh --resend {name} 0 {want})")
    written = 0
    for seq in newer:
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            archive = os.path.join(tmp, f"{name}.snap-{seq:03d}.tgz")
            with open(archive, "wb") as fh:
                assemble(name, seq, snaps[seq], fh)
            written += rb.apply(seq, archive, file_sha256(archive))
    n, size = rb.verify_disk()
    if newer:
        print(f"unsnap: {name}: rebuilt {os.path.join(dest, name)} and {name}.log from snapshots"
              f" {newer[0]}-{newer[-1]}: {n} files, {size} bytes ({written} new); last snapshot"
              f" {newer[-1]}; every file's sha256 checked")
    else:
        print(f"unsnap: {name}: {os.path.join(dest, name)} is up to date at snapshot {last};"
              f" nothing applied (no-op); {n} files, {size} bytes, every file's sha256 checked")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    dest, sources = argv[0], argv[1:]
    try:
        found = find(sources)
        if not found:
            raise Refused(f"no NAME.snap-SSS.tgz.* files in {' '.join(sources)}")
        for name in sorted(found):
            unsnap(dest, name, found[name])
    except Refused as exc:
        print(f"unsnap: refused: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
