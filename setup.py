"""Only what pyproject.toml cannot say: the built-in recipes live in the repository's top-level recipes/
(where a reader looks for them) and ship in the wheel as the package deepinfer.recipes (package-dir mapping;
pyproject's packages.find cannot add a package that has no directory under deepinfer/)."""

from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["deepinfer*"]) + ["deepinfer.recipes"],
      package_dir={"deepinfer.recipes": "recipes"})
