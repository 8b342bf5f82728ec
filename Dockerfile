# lance-sink container image.
#
#   docker build -t lance-sink:0.1.0 .
#   docker run --rm -v "$PWD/config/examples:/config:ro" lance-sink:0.1.0 check-config /config/quickstart.toml
#
# Two stages: `build` creates a virtualenv with the runtime dependencies pinned by
# requirements.lock (used as constraints, so the lock's test and lint tools stay out), then
# installs the project into it; the final stage copies only that virtualenv onto a clean slim
# Python and runs it as an unprivileged user. Every runtime dependency ships binary wheels;
# the build stage has a C++ compiler for the project's own extension (sink/_vector_scan.cpp),
# the final stage none. The Helm chart runs the image with a read-only root
# filesystem and a writable /tmp.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN apt-get update \
    && apt-get install --yes --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/lance-sink
# Dependencies first, in their own layer: rebuilt only when the lock or pyproject changes.
COPY pyproject.toml requirements.lock ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/runtime.txt \
    && /opt/lance-sink/bin/pip install --constraint requirements.lock --requirement /tmp/runtime.txt
# Then the project itself (no dependency resolution: everything is already pinned above).
COPY README.md setup.py ./
COPY config ./config
COPY engine ./engine
COPY sink ./sink
RUN /opt/lance-sink/bin/pip install --no-deps . \
    && /opt/lance-sink/bin/lance-sink --version

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 lance-sink \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin lance-sink
COPY --from=build /opt/lance-sink /opt/lance-sink
ENV PATH=/opt/lance-sink/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# 9102: /metrics, /healthz, /readyz (observability.metrics_port); 8080: query API (query.port).
EXPOSE 9102 8080
# SIGTERM starts the graceful drain (stop fetching, finish WAL appends, commit, close).
STOPSIGNAL SIGTERM
ENTRYPOINT ["lance-sink"]
CMD ["--help"]
