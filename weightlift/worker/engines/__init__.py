"""Engines the worker runs with weightlift loading (vLLM)."""
