"""Where a store lives: a local directory, or a prefix on object storage through fsspec."""
