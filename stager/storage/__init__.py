"""Moving and checking bytes: sources, copies, paths, hashes, throttling, retries, locks."""
