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


def test_every_package_folder_is_listed() -> None:
    setuptools = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = packages_on_disk(setuptools["package-dir"])
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == set(), "these listed packages have no folder with __init__.py"
