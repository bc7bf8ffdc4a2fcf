"""The two compiled parts: region decoding against the system's libjpeg-turbo, and a
sample's crop plan drawn from its seeded stream in one call.

Both optional: where no compiler (or no libjpeg headers) is found, the build goes on
without them; raypipe then decodes whole images (`raypipe.preprocess.region.available()`
says which) and draws its plans through NumPy, the same plans more slowly. Metadata and
everything else live in pyproject.toml.
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
        ),
        Extension(
            "raypipe.preprocess._draws",
            ["raypipe/preprocess/_draws.c"],
            libraries=["m"],
            # no fused multiply-adds: its arithmetic is Python's and NumPy's, op by op
            extra_compile_args=["-O2", "-ffp-contract=off"],
            optional=True,
        ),
    ]
)
