"""Formats: where samples live and how they are listed, read and written.

The bottom of the data path: `raypipe.formats.storage` (local disk or object storage)
and one module per format: `imagefolder`, `webdataset` (tar shards), `parquet`.
"""
