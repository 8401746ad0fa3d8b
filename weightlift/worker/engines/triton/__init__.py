"""Triton Inference Server with weightlift loading: tritonserver runs vLLM in its Python backend.

Modules: `install` (where tritonserver and the Python backend stub of the engine's Python are),
`repository` (the model repository the worker writes per replica), `backend` (the Python-backend
model, run by Triton's stub: vLLM with `--load-format weightlift`), `engine` (the weightlift
worker side: tritonserver's process, readiness, status, front door).
"""
