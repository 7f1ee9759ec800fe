"""On the CPU, before any device time: does a carried payload hold everything its own wheels need?

Two checks, both of which the device's first call would otherwise make the expensive way:

``requires``  every pinned wheel's own ``Requires-Dist`` (markers evaluated for the device: Linux
              x86_64, CPython 3.12; the extras that the pins' dependents ask for followed, e.g.
              ``nvidia-cutlass-dsl[cu13]``) is met by another pin at a version its specifier
              admits, by a package of the device image (``image-packages.txt``, its list in the
              device tool's KINDS.md), or is left out on purpose by a ``# left-out: NAME reason``
              line of the pins file. Read from the wheels themselves, or from the snapshot of
              their metadata committed beside the pins (``PINS.requires.json``), so that the
              check runs without 1.7 GB of wheels. ``openai`` needing ``distro``, and
              ``nvidia-cutlass-dsl-libs-base`` needing ``nvidia-cutlass-dsl-libs-core``, are what
              this catches.

``imports``   the modules a server imports as it loads and as it builds its model
              (``sglang_imports.ENTRIES`` and ``MODEL_PATH``) are followed through *every*
              package the installed site holds, not only SGLang's own (a dependency's module-level
              imports count: ``openai/_base_client.py`` imports ``distro``), with the folders the
              site's ``.pth`` files add (``cutlass`` lives in
              ``nvidia_cutlass_dsl/dsl_packages``); an import that runs unconditionally and that
              neither the site nor the image provides is reported, with the chain that reaches it.

    python scripts/device/payload_check.py requires PINS [--wheels DIR] [--write-snapshot]
    python scripts/device/payload_check.py imports SITE [MODULE ...]

Exit 0 when nothing is missing, 1 otherwise (each missing requirement or module on a line).
"""
from __future__ import annotations

import argparse
import email.parser
import json
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import sglang_imports  # noqa: E402

#: The device's interpreter and platform, for evaluating requirement markers.
DEVICE_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
              "platform_machine": "x86_64"}
#: Distribution name -> the top-level modules it provides, where they differ from the name.
IMPORT_NAMES = {"pyyaml": ["yaml"], "python-dateutil": ["dateutil"], "pillow": ["PIL"],
                "scikit-learn": ["sklearn"], "scikit-image": ["skimage"], "pyzmq": ["zmq"],
                "opencv-python-headless": ["cv2"], "protobuf": ["google"],
                "prometheus-client": ["prometheus_client"], "typing-extensions": ["typing_extensions"],
                "nvidia-ml-py": ["pynvml"], "cuda-bindings": ["cuda"], "cuda-core": ["cuda"],
                "cuda-pathfinder": ["cuda"], "py-cpuinfo": ["cpuinfo"], "absl-py": ["absl"],
                "hf-xet": ["hf_xet"], "huggingface-hub": ["huggingface_hub"],
                "jax-cuda13-plugin": ["jax_cuda13_plugin"], "attrs": ["attr", "attrs"],
                "msgpack": ["msgpack"], "pytorch-lightning": ["pytorch_lightning"],
                "tensorboard-data-server": ["tensorboard_data_server"]}
LEFT_OUT_RE = re.compile(r"^#\s*left-out:\s*(\S+)\s+(.+)$")
VERSION_OK_RE = re.compile(r"^#\s*version-ok:\s*(\S+)\s+(\S+)\s+(.+)$")


def pins(path: Path) -> dict[str, Version]:
    """Canonical name -> pinned version of every ``NAME==VERSION`` line."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, version = line.split("==")
            out[canonicalize_name(name)] = Version(version)
    return out


def left_out(path: Path) -> dict[str, str]:
    """Canonical name -> why the pins leave it out (``# left-out: NAME reason`` lines)."""
    out = {}
    for line in path.read_text().splitlines():
        m = LEFT_OUT_RE.match(line.strip())
        if m:
            out[canonicalize_name(m.group(1))] = m.group(2).strip()
    return out


def version_ok(path: Path) -> set[tuple[str, str]]:
    """(needer, dependency) pairs whose pinned versions disagree on purpose
    (``# version-ok: NEEDER DEP reason`` lines)."""
    out = set()
    for line in path.read_text().splitlines():
        m = VERSION_OK_RE.match(line.strip())
        if m:
            out.add((canonicalize_name(m.group(1)), canonicalize_name(m.group(2))))
    return out


def image_packages(path: Path = HERE / "image-packages.txt") -> set[str]:
    return {canonicalize_name(line.strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def wheel_requires(wheel: Path) -> tuple[str, list[str]]:
    """(canonical name, its Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist()
                         if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode("utf-8", "replace"))
    return canonicalize_name(meta["Name"]), list(meta.get_all("Requires-Dist") or [])


def snapshot(wheels: Path) -> dict[str, list[str]]:
    """Canonical name -> Requires-Dist lines, for every wheel in ``wheels``."""
    out = {}
    for wheel in sorted(wheels.glob("*.whl")):
        name, reqs = wheel_requires(wheel)
        out[name] = reqs
    return out


def unmet(pinned: dict[str, Version], requires: dict[str, list[str]], image: set[str],
          skipped: dict[str, str], accepted: set[tuple[str, str]] = frozenset()) -> list[str]:
    """Every requirement of a pinned distribution (with the extras its dependents ask for)
    that nothing meets, as ``"NEEDER needs REQUIREMENT: why not"``."""
    extras: dict[str, set[str]] = {name: set() for name in pinned}
    changed = True
    while changed:  # extras asked of a pin can ask for more extras of another
        changed = False
        for name in pinned:
            for line in requires.get(name, []):
                req = Requirement(line)
                dep = canonicalize_name(req.name)
                if dep in extras and _applies(req, extras[name]) and not req.extras <= extras[dep]:
                    extras[dep] |= req.extras
                    changed = True
    problems = []
    for name in sorted(pinned):
        if name not in requires:
            problems.append(f"{name}: no metadata in the snapshot (rebuild it from the wheels)")
            continue
        for line in requires[name]:
            req = Requirement(line)
            if not _applies(req, extras[name]):
                continue
            dep = canonicalize_name(req.name)
            if dep in pinned:
                if (req.specifier and not req.specifier.contains(pinned[dep], prereleases=True)
                        and (name, dep) not in accepted):
                    problems.append(f"{name} needs {req}: pinned {dep}=={pinned[dep]}")
            elif dep not in image and dep not in skipped:
                problems.append(f"{name} needs {req}: neither pinned nor on the device image "
                                f"(pin it, or add '# left-out: {dep} WHY' to the pins)")
    return problems


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**DEVICE_ENV, "extra": e}) for e in ({""} | extras))


def image_modules(image: set[str]) -> set[str]:
    """Top-level module names the image's distributions provide (by name, or IMPORT_NAMES)."""
    out = set()
    for dist in image:
        out.update(IMPORT_NAMES.get(dist, [dist.replace("-", "_")]))
    return out


def missing_imports(site: Path, entries: list[str], image: set[str]) -> list[str]:
    """Required load-time imports (followed through every package in ``site`` and the folders
    its ``.pth`` files add) that resolve neither in the site nor to an image package."""
    found = sglang_imports.closure(site, entries, follow_all=True)
    have = image_modules(image)
    out = []
    for module, (kind, chain) in sorted(found.missing.items()):
        if kind == "required" and module.split(".")[0] not in have:
            out.append(f"{module} (imported by {' <- '.join(chain)})")
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("requires", help="every pinned wheel's Requires-Dist is met")
    r.add_argument("pins", type=Path)
    r.add_argument("--wheels", type=Path, help="the downloaded wheels (default: the snapshot)")
    r.add_argument("--write-snapshot", action="store_true",
                   help="write PINS.requires.json from --wheels")
    i = sub.add_parser("imports", help="load-time imports through every package of a site")
    i.add_argument("site", type=Path)
    i.add_argument("modules", nargs="*")
    args = ap.parse_args(argv)
    image = image_packages()
    if args.cmd == "requires":
        snap_path = args.pins.with_name(args.pins.name.replace(".txt", ".requires.json"))
        if args.wheels:
            requires = snapshot(args.wheels)
            if args.write_snapshot:
                snap_path.write_text(json.dumps(requires, indent=1, sort_keys=True) + "\n")
        else:
            requires = json.loads(snap_path.read_text())
        problems = unmet(pins(args.pins), requires, image, left_out(args.pins),
                         version_ok(args.pins))
    else:
        entries = args.modules or sglang_imports.ENTRIES + sglang_imports.MODEL_PATH
        problems = missing_imports(args.site, entries, image)
    for line in problems:
        print(f"MISSING {line}")
    print(f"[payload-check] {args.cmd}: {len(problems)} missing")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
