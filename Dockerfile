# One image for every sapd job (`python -m jobs.<name>`), two targets:
#   docker build --target cpu -t ghcr.io/sapd/sapd:0.1.0-cpu \
#       --build-arg TORCH_INDEX_URL=<the PyTorch CPU wheel index> .
#   docker build --target gpu -t ghcr.io/sapd/sapd:0.1.0-gpu .
# gpu: the default torch wheels (CUDA runtime libraries come as wheels), vLLM and DeepSpeed.
# DeepSpeed is installed with DS_BUILD_OPS=0: no CUDA compiler in the image, ops are not prebuilt.
# Both run as the unprivileged user sapd (uid 1000, as in charts/sapd securityContext) from /app.

FROM python:3.11-slim-bookworm AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN groupadd --gid 1000 sapd \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/sapd --shell /usr/sbin/nologin sapd
WORKDIR /app
# what `pip install .` needs, and nothing else (.dockerignore keeps the rest out of the context)
COPY pyproject.toml README.md ./
COPY sapd ./sapd
COPY jobs ./jobs

FROM base AS cpu
ARG TORCH_VERSION=2.13.0
# empty: the default index; pass the PyTorch CPU wheel index to get the small CPU build
ARG TORCH_INDEX_URL=
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}" \
 && DS_BUILD_OPS=0 pip install ".[train,k8s]" "torch==${TORCH_VERSION}" \
 && python -c "import sapd, jobs.teacher_scores, jobs.train, jobs.build_prefixes"
USER 1000:1000
CMD ["python", "-m", "sapd.cli", "--help"]

FROM base AS gpu
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}" \
 && DS_BUILD_OPS=0 pip install ".[train,vllm,k8s]" "torch==${TORCH_VERSION}" \
 && python -c "import sapd, jobs.teacher_scores, jobs.train, jobs.build_prefixes"
USER 1000:1000
CMD ["python", "-m", "sapd.cli", "--help"]
