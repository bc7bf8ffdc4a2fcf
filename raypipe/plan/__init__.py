"""The driver's plan, pure: shards listed with dense keys, the one seeded order of an epoch,
each rank's keys and tasks, block and task sizes from the object store.

Imports `raypipe.config` and `raypipe.formats`.
"""
