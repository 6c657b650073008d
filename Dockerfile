# The image k8s/rayservice.yaml runs (head and workers): Ray, specpool with its shipped zoo
# drafters, and the default target converted once, so pods start without downloading anything.
#   docker build -t ghcr.io/YOUR_ORG/specpool:0.1.0 .
# For GPU nodes build from the -gpu tag of the same Ray version; torch then comes with CUDA.
# The Ray version must equal rayClusterConfig.rayVersion in k8s/rayservice.yaml (a test checks).
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311
FROM ${RAY_IMAGE}

ENV SPECPOOL_HOME=/home/ray/.cache/specpool \
    PIP_NO_CACHE_DIR=1
WORKDIR /home/ray/specpool
COPY --chown=ray:users pyproject.toml README.md ./
# One installed package; the benchmarks, their results and the tests stay out of the image.
COPY --chown=ray:users specpool ./specpool
RUN pip install . \
    && specpool models fetch \
    && specpool --help > /dev/null
