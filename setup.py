"""Packaging: each room (a top-level folder) is one subpackage of `weightlift`.

The folders keep their short names (operator/, worker/, ...) and have no top-level __init__.py:
a folder `operator/` with one would shadow the stdlib `operator` module whenever Python runs from
the repo root. setuptools' automatic discovery cannot map a folder to a different package name,
so the subpackages inside each room are discovered here instead of listed by hand.
"""

from setuptools import find_packages, setup

ROOMS = ("api", "operator", "worker", "local", "bench")

package_dir = {f"weightlift.{room}": room for room in ROOMS}
packages = [
    name
    for room in ROOMS
    for name in (f"weightlift.{room}", *(f"weightlift.{room}.{sub}" for sub in find_packages(room)))
]

setup(package_dir=package_dir, packages=packages)
