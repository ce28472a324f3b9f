"""Packaging beyond what pyproject.toml can say: the top-level `recipes/` directory is installed as the
package `occult_ft.recipes`, so `occult-ft train tiny` finds the shipped recipes from a wheel while the
repository keeps one copy of them at the documented place (which files: pyproject's package-data)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["occult_ft", "occult_ft.*"]) + ["occult_ft.recipes"],
    package_dir={"occult_ft.recipes": "recipes"},
)
