"""The applications: the raypipe command, jobs, converting to shards."""
