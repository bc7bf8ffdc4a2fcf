"""Inside the preprocessing actors: the actor (`actor`) and the Ray Datasets that run it
(`datasets`), the seeded crop plan, the decoders, the blocks they fill, the user's own
transform, samples with no image (`samples/`).

Imports `raypipe.skips`, `raypipe.plan` and below.
"""
