# Two images from one distribution. The local stack (local/) and the benchmarks (bench/) are
# never installed in either: they are development tools.
#   docker build --target operator -t weightlift/operator .   (kopf, no torch)
#   docker build --target worker   -t weightlift/worker   .   (torch, safetensors, NIXL)
FROM python:3.11-slim AS base
RUN useradd --uid 1000 --create-home weightlift
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY weightlift weightlift
# The images ship none of the dev-only rooms.
RUN rm -rf weightlift/local weightlift/bench

FROM base AS operator
RUN rm -rf weightlift/worker && pip install --no-cache-dir . && rm -rf /opt/weightlift
USER 1000
ENTRYPOINT ["weightlift", "operator"]

FROM base AS worker
RUN pip install --no-cache-dir "torch>=2.5" && pip install --no-cache-dir ".[worker,p2p]" \
    && rm -rf /opt/weightlift
USER 1000
ENTRYPOINT []
CMD ["weightlift", "worker"]
