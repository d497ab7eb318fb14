"""``stage-in --fanout``: one read of the source for all nodes, shared over a gloo group."""
