"""The contract: CRD types, the worker's assignment and report, labels.

Imports nothing else of ours.
"""
