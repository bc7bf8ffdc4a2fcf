"""The frozen configs every layer reads: `PipelineConfig` (one dataset's pipeline, also
from YAML) and `LoaderConfig` (each rank's iterator), checked at the edge."""

from raypipe.config.checks import check_keys, load_yaml, resolve_callable
from raypipe.config.loader import IMAGENET_MEAN, IMAGENET_STD, LoaderConfig, rank_loader
from raypipe.config.pipeline import PipelineConfig
from raypipe.config.validate import COMPUTE, FORMATS, INPUTS, ON_ERROR

__all__ = [
    "COMPUTE",
    "FORMATS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INPUTS",
    "LoaderConfig",
    "ON_ERROR",
    "PipelineConfig",
    "check_keys",
    "load_yaml",
    "rank_loader",
    "resolve_callable",
]
assert __all__ == sorted(__all__)
