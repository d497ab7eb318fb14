"""stage-in: copy a dataset's shards to node-local scratch, verified, atomic, resumable."""
