"""weightlift: a Kubernetes operator that gets model weights onto GPUs fast and calls a model
Ready only once it answers inference.

The package has four rooms (ARCHITECTURE.md): `api` (the contract), `operator` (kopf),
`worker` (hooks, loaders, P2P, engines) and `local` (the development stack), plus `bench`.
Import contracts in `.importlinter` keep the walls between them.
"""
