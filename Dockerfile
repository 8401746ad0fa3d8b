# Two images from one distribution. The local stack (local/) and the benchmarks (bench/) are
# never installed in either: they are development tools.
#   make images   (buildah, no daemon; see README "Images")
#   docker build --target operator -t ghcr.io/weightlift/weightlift:0.1.0 .   (kopf, no torch)
#   docker build --target worker   -t ghcr.io/weightlift/worker:0.1.0      .   (torch, safetensors, NIXL)
# BASE: any Debian-like image with python3.11, pip and useradd; where no registry is reachable,
# hack/build-image-base.sh makes one from Debian packages.
ARG BASE=python:3.11-slim
FROM ${BASE} AS base
RUN useradd --uid 1000 --create-home weightlift
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY weightlift weightlift
# The images ship none of the dev-only rooms.
RUN rm -rf weightlift/local weightlift/bench

FROM base AS operator
# PIP_CERT (build time only, never in the image): a CA bundle for a TLS-intercepting egress proxy.
ARG PIP_CERT
RUN rm -rf weightlift/worker && pip install --no-cache-dir . && rm -rf /opt/weightlift
USER 1000
ENTRYPOINT ["weightlift", "operator"]

FROM base AS worker
ARG PIP_CERT
RUN pip install --no-cache-dir "torch>=2.5" && pip install --no-cache-dir ".[worker,p2p]" \
    && rm -rf /opt/weightlift
USER 1000
ENTRYPOINT []
CMD ["weightlift", "worker"]
