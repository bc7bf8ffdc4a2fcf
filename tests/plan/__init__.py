"""The driver's plan: shards, the seeded order, each rank's keys and tasks."""
