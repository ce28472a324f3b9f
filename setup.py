"""Packaging beyond what pyproject.toml can say: the top-level `recipes/` directory is installed as the
package `occult_ft.recipes`, so `occult-ft train tiny` finds the shipped recipes from a wheel while the
repository keeps one copy of them at the documented place (which files: pyproject's package-data).
Folders of data (the embedded model and corpus, the card template) are listed as packages too, as
setuptools asks for every folder whose files are package data."""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["occult_ft", "occult_ft.*"], exclude=["*.__pycache__"])
    + ["occult_ft.recipes"],
    package_dir={"occult_ft.recipes": "recipes"},
)
