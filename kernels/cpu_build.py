"""The CPU kernels (kernels/csrc/) built ahead of time, one shared library per ISA level, and the one this
CPU loads.

``python -m pagedserve.kernels.cpu_build`` (``make setup``, the engine image's Dockerfile) compiles every
level of ``FLAVOURS`` into ``kernels/prebuilt/`` with a manifest naming the torch version and the
sources' hash they were built from: x86-64 gets an AVX2 build (the baseline: AVX2, FMA, F16C) and an
AVX512-VNNI one, any machine the generic build. At start ``library_for`` picks the best level the CPU has
(kernels/cpu_features.py) and returns its prebuilt library when the manifest matches, so no start
compiles anything. Otherwise (a source checkout never built, another torch) it builds that one level
into a cache folder unique to this install, torch and sources, under ``pagedserve.cache.exclusive``: a
build killed midway leaves no lock, only a temporary folder that the next start removes, saying so.

The levels are separate libraries, not one with per-function targets, because every library registers
the same ``torch.ops.pagedserve`` ops: a process loads exactly one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagedserve.cache import cache_root, exclusive

from .cpu_features import ISA_LEVELS, CpuFeatures

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
PREBUILT = Path(__file__).parent / "prebuilt"
MANIFEST = "manifest.json"
SOURCES = ("paged_attention_cpu.cpp", "elementwise_cpu.cpp", "w8a16_cpu.cpp", "gguf_cpu.cpp")


@dataclass(frozen=True)
class Flavour:
    """One ISA level's build: its compiler flags (kernels/csrc/simd.h and gguf_cpu.cpp branch on the
    macros they define: AVX2 + FMA, then AVX512-VNNI's dpbusd for the GGUF blocks)."""

    level: str
    cflags: tuple[str, ...]
    x86_only: bool

    @property
    def library_name(self) -> str:
        return f"pagedserve_cpu_{self.level}.so"


FLAVOURS = (
    Flavour("avx512vnni", ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                           "-mavx512vnni"), x86_only=True),
    Flavour("avx2", ("-mavx2", "-mfma", "-mf16c"), x86_only=True),
    Flavour("generic", (), x86_only=False),
)
assert [flavour.level for flavour in FLAVOURS] == list(ISA_LEVELS)


@dataclass(frozen=True)
class KernelLibrary:
    """The library a process loads, and where it came from (``/version`` reports both)."""

    path: Path
    level: str
    origin: str  # "prebuilt" (kernels/prebuilt/) or "cache" (built at start, kept in the user cache)


def flavour_for(features: CpuFeatures) -> Flavour:
    return next(flavour for flavour in FLAVOURS if flavour.level == features.isa)


def buildable_flavours() -> list[Flavour]:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return [flavour for flavour in FLAVOURS if x86 or not flavour.x86_only]


def sources_key() -> str:
    """The sources, the compile command's fixed part and torch's version: a library built from another
    key is not loaded (another torch may change the ABI the ops link against)."""
    import torch

    digest = hashlib.blake2b(digest_size=8)
    for path in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(_common_cflags()).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()


def library_for(features: CpuFeatures) -> KernelLibrary:
    """The library of the best level this CPU has: prebuilt if it matches, else built into the cache."""
    flavour = flavour_for(features)
    key, prebuilt_key = sources_key(), _manifest_key(PREBUILT)
    prebuilt = PREBUILT / flavour.library_name
    if prebuilt_key == key and prebuilt.is_file():
        return KernelLibrary(prebuilt, flavour.level, "prebuilt")
    folder = jit_folder(key)
    library = folder / flavour.library_name
    if not library.is_file():
        reason = "no prebuilt kernels" if prebuilt_key is None else "prebuilt for other sources"
        logger.warning("Building the %s CPU kernels into %s (%s in %s; `make setup` or "
                       "`python -m pagedserve.kernels.cpu_build` builds them ahead of time)",
                       flavour.level, folder, reason, PREBUILT)
        build_into(folder, [flavour], key)
    return KernelLibrary(library, flavour.level, "cache")


def jit_folder(key: str) -> Path:
    """This install's build folder: keyed by the package's path and Python's prefix as well as the
    sources, so two checkouts or virtualenvs never build over each other."""
    install = hashlib.blake2b(f"{Path(__file__).resolve().parent}:{sys.prefix}".encode(), digest_size=4)
    return cache_root() / "cpu-kernels" / f"{install.hexdigest()}-{key}"


def build_into(folder: Path, flavours: list[Flavour], key: str) -> None:
    """Compile ``flavours`` into ``folder`` (beside a manifest of ``key``), unless already there.

    Each library is linked in a temporary sibling folder and renamed into place while holding the
    folder's lock; a temporary folder found under the lock was left by a build that died, and is removed."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(folder.parent / f".{folder.name}.lock", "building the CPU kernels"):
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
            logger.warning("Removing %s, left by a kernel build that did not finish; building again", stale)
            shutil.rmtree(stale, ignore_errors=True)
        missing = [flavour for flavour in flavours if not (folder / flavour.library_name).is_file()]
        if not missing:
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            for flavour in missing:
                _compile(flavour, tmp)
            folder.mkdir(exist_ok=True)
            for flavour in missing:
                (tmp / flavour.library_name).replace(folder / flavour.library_name)
            levels = sorted({*(_manifest(folder).get("levels", [])), *(f.level for f in missing)})
            (folder / MANIFEST).write_text(json.dumps({"key": key, "levels": levels}, indent=1) + "\n")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _compile(flavour: Flavour, out: Path) -> None:
    """One library from SOURCES: the translation units in parallel, then the link."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r}) to build the CPU kernels")
    cflags, what = [*_common_cflags(), *flavour.cflags], f"the {flavour.level} CPU kernels"
    objects = [out / f"{flavour.level}-{Path(source).stem}.o" for source in SOURCES]
    commands = [[compiler, *cflags, "-c", str(CSRC / source), "-o", str(obj)]
                for source, obj in zip(SOURCES, objects, strict=True)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in pool.map(_run, commands):
            if done.returncode:
                raise RuntimeError(f"compiling {what} failed:\n{done.stderr[-3000:]}")
    link = [compiler, *map(str, objects), *_link_flags(), "-o", str(out / flavour.library_name)]
    done = _run(link)
    if done.returncode:
        raise RuntimeError(f"linking {what} failed:\n{done.stderr[-3000:]}")
    for obj in objects:
        obj.unlink()


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True)


def _common_cflags() -> list[str]:
    """What torch's extension builder would pass (no Python: the ops register through TORCH_LIBRARY).
    -fopenmp: at::parallel_for's pragmas compile to nothing without it; the libgomp it links is the one
    torch has loaded (the same soname), so one thread pool for torch's ops and ours."""
    import torch
    from torch.utils.cpp_extension import include_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [flag for path in include_paths() for flag in ("-isystem", path)]
    return ["-O3", "-fPIC", "-std=c++20", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{CSRC}", *includes]


def _link_flags() -> list[str]:
    from torch.utils.cpp_extension import library_paths

    paths = [f"-L{path}" for path in library_paths()]
    return ["-shared", "-fopenmp", *paths, "-lc10", "-ltorch_cpu", "-ltorch"]


def _manifest(folder: Path) -> dict:
    try:
        value = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _manifest_key(folder: Path) -> str | None:
    return _manifest(folder).get("key")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the CPU kernels of every ISA level ahead of time.")
    parser.add_argument("--out", type=Path, default=PREBUILT, help=f"where to put them (default {PREBUILT})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    flavours = buildable_flavours()
    key = sources_key()
    if _manifest_key(args.out) != key:  # another torch or other sources: start afresh
        for stale in [args.out / MANIFEST, *(args.out / flavour.library_name for flavour in FLAVOURS)]:
            stale.unlink(missing_ok=True)
    build_into(args.out, flavours, key)
    print(f"CPU kernels for {', '.join(f.level for f in flavours)} in {args.out} "
          f"(python {sysconfig.get_python_version()}, key {key})")


if __name__ == "__main__":
    main()
