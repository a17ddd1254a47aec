"""The distribution ships every subpackage: pyproject.toml lists them by hand (each top-level folder is
mapped onto ``pagedserve.*`` by ``package-dir``), and a folder missing from the list is absent from a
wheel and the images while every test of the checkout still imports it from the source tree."""

from __future__ import annotations

from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration  # parses TOML on 3.10 too

ROOT = Path(__file__).resolve().parents[1]


def packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    found = set()
    for package, folder in package_dir.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *relative.parts]))
    return found


TEST_KIT = "pagedserve.testing"  # on disk, deliberately not in the wheel


def test_every_package_folder_is_listed() -> None:
    setuptools = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = packages_on_disk(setuptools["package-dir"]) - {TEST_KIT}
    assert TEST_KIT not in listed, "the test kit must stay out of the wheel"
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "these listed packages have no folder with __init__.py"


def test_the_wheel_carries_the_product_and_no_test_kit(tmp_path) -> None:
    """``pip wheel .``: every listed package is in it, the test kit is not, and the clone's editable
    install still imports the test kit (what tests, e2e and the benchmarks use)."""
    import shutil
    import subprocess
    import sys
    import zipfile

    import pagedserve.testing

    # The image's build context (.dockerignore's allow-list), copied: a build/ left in the checkout by an
    # earlier build would otherwise end up in the wheel whatever pyproject.toml says.
    context = tmp_path / "context"
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for name in allowed:
        source, target = ROOT / name, context / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(source, target)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(context)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("pagedserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.startswith("pagedserve/testing/")] == []
    assert not [n for n in names if n.endswith("/testing.py") or "_fakes" in n or "_helpers" in n]
    setuptools = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    for package in setuptools["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert Path(pagedserve.testing.__file__).parent == ROOT / "pagedserve" / "testing"
