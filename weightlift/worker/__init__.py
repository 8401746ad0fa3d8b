"""The worker: init hooks, loaders, P2P, engines. Runs in GPU pods."""
