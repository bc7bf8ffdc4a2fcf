"""Inside the actors: the crop plan, decoders, user transforms, bad samples, seeds, memory."""
