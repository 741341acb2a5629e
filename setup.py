"""The compiled parts (the rest of the build is in pyproject.toml).

``lightning_repro.data._seedkernel`` seeds python's and numpy's streams a batch at a time;
``lightning_repro.checkpoint._rowsums`` computes the restore check's row checksums in one pass over memory. Both are
optional: without a C compiler the build warns and goes on, and lightning-repro seeds through the library calls and
checksums through torch instead (same values, slower; see ``lightning_repro/data/fastrng.py`` and
``lightning_repro/checkpoint/hashing.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("lightning_repro.data._seedkernel", sources=["lightning_repro/data/_seedkernel.c"], optional=True),
        Extension(
            "lightning_repro.checkpoint._rowsums", sources=["lightning_repro/checkpoint/_rowsums.c"], optional=True
        ),
    ]
)
