"""The decoded cache (``PipelineConfig.cache``): capped pixels kept on the node that
decoded them, so later epochs crop without reading or decoding.

capped (decode to the capped size, crop from it) · store (`Entry`, `Tally`) · disk
(`DiskStore`, a node's entries as files: in shared memory or under ``cache_dir``) · node
(`NodeCache`, one actor per node: the directory's lifetime, the budget, the counts) · reuse
(`SampleCache`, what a preprocessing worker calls).
"""
