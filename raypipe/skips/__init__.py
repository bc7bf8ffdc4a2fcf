"""Bad samples: why one was dropped (`records`), the skip log the actors write to (`log`),
and the budget that stops a run with too many (`budget`).

Imports nothing else of raypipe's: every layer above may use it.
"""
