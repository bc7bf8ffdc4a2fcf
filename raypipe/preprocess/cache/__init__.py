"""The decoded cache (``PipelineConfig.cache``): capped pixels kept on the node that
decoded them, so later epochs crop without reading or decoding.

capped (decode to the capped size, crop from it) · store (`MemoryStore`, entries) · disk
(`DiskStore`, node-local files) · node (`NodeCache`, one actor per node) · reuse
(`SampleCache`, what a preprocessing actor calls).
"""
