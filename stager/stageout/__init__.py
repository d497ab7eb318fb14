"""stage-out and restore: checkpoints from scratch to persistent storage, committed atomically."""
