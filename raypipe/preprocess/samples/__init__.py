"""Samples with no image (``PipelineConfig.image_column=None``), made in the actors: a
sample's fields decoded (`fields`: audio by `audio`, JSON, text, NumPy members), then the
user's transform if there is one."""
