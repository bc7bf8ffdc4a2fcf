"""The driver's plan: shards listed with dense keys, the one seeded order of an epoch, each
rank's keys and tasks, block and task sizes from the object store. Pure functions of the
listing, the config, the seed and the world size, but for listing the files and reading
the store's size.

Imports `raypipe.config` and `raypipe.formats`.
"""
