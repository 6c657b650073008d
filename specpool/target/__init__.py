"""Target runtime: model loading, KV caches, sampling parameters and lossless verification."""
