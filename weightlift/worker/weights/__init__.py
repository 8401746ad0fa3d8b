"""The floor under loaders/ and p2p/: the safetensors format (header, shard files, tensor
views) and the load vocabulary (LoadError, LoadProgress). Imports nothing else of the worker."""
