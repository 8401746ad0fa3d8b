"""The operator (kopf): thin handlers, pure planning, apply. No torch, no local stack."""
