"""Packages are discovered (every subpackage of tecupy ships); the kernel sources live at the
top of the repository and are mapped into the package as tecupy.cuda and
tecupy.cutlass_templates. Everything else is in pyproject.toml."""
from setuptools import find_packages, setup

KERNEL_DIRS = {"tecupy.cuda": "cuda", "tecupy.cutlass_templates": "cutlass_templates"}

setup(packages=find_packages(include=["tecupy", "tecupy.*"]) + list(KERNEL_DIRS),
      package_dir=KERNEL_DIRS)
