"""The one compiled part: the tar walk that indexes shards as stage-in copies them
(stager/shards/_tarwalk.c). Everything else is in pyproject.toml.

``optional=True``: where no C compiler is found the package still installs, and the walk's
callers use the numpy scanner instead (stager/shards/tarnative.py says which one runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stager.shards._tarwalk",
            ["stager/shards/_tarwalk.c"],
            optional=True,
        )
    ]
)
