"""One rank's side: the iterator, re-batching, host to device, the run-long pipeline."""
