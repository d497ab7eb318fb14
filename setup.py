"""The compiled parts: the tar walk that indexes shards as stage-in copies them
(stager/shards/_tarwalk.c), the byte pump that reads, hashes, walks and writes a block in one
call (stager/storage/_bytepump.c, with xxHash's header vendored beside it), and the run of stats
that sizes walked shards beside the copies (stager/storage/_statmany.c). Everything else is in
pyproject.toml.

``optional=True``: where no C compiler is found the package still installs, and the callers
use Python instead: the numpy scanner (stager/shards/tarnative.py says which one runs), the
buffered copy (stager/storage/bytepath.py), and ``os.stat`` (stager/storage/statmany.py).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "stager.shards._tarwalk",
            ["stager/shards/_tarwalk.c"],
            optional=True,
        ),
        Extension(
            "stager.storage._bytepump",
            ["stager/storage/_bytepump.c", "stager/storage/_copyrun.c"],
            depends=[
                "stager/storage/_bytepump.h",
                "stager/storage/vendor/xxhash.h",
                "stager/shards/_tarwalk_api.h",
            ],
            optional=True,
        ),
        Extension(
            "stager.storage._statmany",
            ["stager/storage/_statmany.c"],
            optional=True,
        ),
    ]
)
