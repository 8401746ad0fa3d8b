"""Storage readers: s3:// and hf:// into a local model directory, and the node-local cache."""
