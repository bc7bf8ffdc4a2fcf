"""Ray Train: train_ddp, checkpoints and resuming."""
