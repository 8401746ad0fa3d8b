"""vLLM with weightlift loading: the `weightlift` load format and the worker that runs vLLM.

Modules: `plugin` (the `vllm.general_plugins` entry point), `loader` (the BaseModelLoader; imports
vLLM), `weights` (what the loader does, free of vLLM), `serve` (starts vLLM's OpenAI server),
`engine` (the weightlift worker side: command line, process, status, proxies).
"""
