"""The wheel's packages, derived from the source folders so that a new subpackage cannot be left out.

The layers live in top-level folders (spec/, machine/, runtime/, properties/) and install as
subpackages of decodespec; PACKAGE_DIR maps each package to its folder, and every folder with an
__init__.py below one is a package. The rest of the metadata is pyproject.toml's.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {"decodespec": "decodespec", "decodespec.spec": "spec", "decodespec.machine": "machine",
               "decodespec.runtime": "runtime", "decodespec.properties": "properties"}


def packages() -> list[str]:
    """Each mapped package and every package found below its folder."""
    return sorted({name for pkg, folder in PACKAGE_DIR.items()
                   for name in (pkg, *(f"{pkg}.{sub}" for sub in find_packages(folder)))})


if __name__ == "__main__":
    setup(package_dir=PACKAGE_DIR, packages=packages())
