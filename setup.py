"""The one compiled part: ``lightning_repro.data._seedkernel`` (the rest of the build is in pyproject.toml).

It is optional: without a C compiler the build warns and goes on, and lightning-repro seeds through the library
calls instead (same values, slower; see ``lightning_repro/_fastrng.py``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("lightning_repro.data._seedkernel", sources=["lightning_repro/data/_seedkernel.c"], optional=True),
    ]
)
