"""Sharded model state over the flattened dp x sp group (DESIGN 11)."""
