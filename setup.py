"""The one compiled part: region decoding against the system's libjpeg-turbo.

Optional: where no compiler or no libjpeg headers are found, the build goes on without it
and raypipe decodes whole images (`raypipe.preprocess.region.available()` says which).
Metadata and everything else live in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "raypipe.preprocess._jpegregion",
            ["raypipe/preprocess/_jpegregion.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
