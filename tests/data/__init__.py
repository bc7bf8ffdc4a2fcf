"""The data layer: listing, decoding, the actors, skips, the pool."""
