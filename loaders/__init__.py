"""loaders: a rank-aware, drop-in DataLoader over staged WebDataset shards (being built)."""

__all__: list[str] = []
