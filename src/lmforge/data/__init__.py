"""Data: document sources, pretokenized shards, packed and padded rows."""
