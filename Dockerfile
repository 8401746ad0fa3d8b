# Image for both the operator and the worker (the worker extra brings torch and NIXL).
FROM python:3.11-slim
RUN useradd --uid 1000 --create-home weightlift
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY operator operator
COPY worker worker
RUN pip install --no-cache-dir "torch>=2.5" && pip install --no-cache-dir ".[worker,p2p]"
USER 1000
ENTRYPOINT []
CMD ["weightlift", "--help"]
