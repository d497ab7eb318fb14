"""What a shard is: the manifest, the tar format (members, indexes, counts), and building them."""
