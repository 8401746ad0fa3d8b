# Two images from one distribution. The local stack (local/) and the benchmarks (bench/) are
# never installed in either: they are development tools.
#   make images   (buildah, no daemon; see README "Images")
#   docker build --target operator -t ghcr.io/weightlift/weightlift:0.1.0 .   (kopf, no torch)
#   docker build --target worker   -t ghcr.io/weightlift/worker:0.1.0      .   (torch, safetensors, NIXL)
# BASE: any Debian-like image with python3.11, pip and useradd; where no registry is reachable,
# hack/build-image-base.sh makes one from Debian packages.
ARG BASE=python:3.11-slim
FROM ${BASE} AS runtime
RUN useradd --uid 1000 --create-home weightlift

FROM runtime AS operator
# PIP_CERT (build time only, never in the image): a CA bundle for a TLS-intercepting egress proxy.
ARG PIP_CERT
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY weightlift weightlift
# The images ship none of the dev-only rooms; the operator none of the worker either.
RUN rm -rf weightlift/local weightlift/bench weightlift/worker \
    && pip install --no-cache-dir . && rm -rf /opt/weightlift
USER 1000
ENTRYPOINT ["weightlift", "operator"]

FROM runtime AS worker
ARG PIP_CERT
# torch (~5 GB with its CUDA wheels) in a layer of its own, before the code: a code change
# rebuilds only the layers below it.
RUN pip install --no-cache-dir "torch>=2.5"
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY weightlift weightlift
RUN rm -rf weightlift/local weightlift/bench \
    && pip install --no-cache-dir ".[worker,p2p]" && rm -rf /opt/weightlift
USER 1000
ENTRYPOINT []
CMD ["weightlift", "worker"]
