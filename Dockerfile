# One image for every sapd job (`python -m sapd.jobs.<name>`), three targets:
#   cpu   torch (CPU wheel), DeepSpeed, the k8s client, TextWorld and the BM25 retriever: CPU clusters,
#         the smoke overlay (charts/sapd/values/smoke.yaml)
#   gpu   torch with its CUDA wheels, vLLM, DeepSpeed, the k8s client: the stage Jobs on GPU pools
#   eval  gpu + the benchmark environments (TextWorld, ALFWorld, the BM25 retriever): the chart's
#         evaluation Job and CronJob use it when the chart's image flavor is gpu
# What each target installs is docker/install.sh's table, under docker/constraints-cpu.txt (cpu) or
# docker/constraints-gpu.txt (gpu, eval: vLLM's pins); the same script builds the test harness's pod
# environments, and tests/cluster/test_images.py resolves each target with pip as this file installs it.
# Build and push under the name the chart pulls (<repository>:<appVersion>-<target>; docs/kubernetes/install.md "The image"):
#   scripts/build_image.sh --target cpu --repository <registry>/sapd [--push]
#   docker build --target gpu -t <registry>/sapd:0.1.0-gpu . && docker push <registry>/sapd:0.1.0-gpu
# Layers: dependencies first (`*-deps` stages, installed from pyproject.toml with only sapd/__init__.py
# present), the source last, so a code change rebuilds only the last, small layer.
# CUDA comes from the torch/vLLM wheels (CUDA 13 user space: the nodes' NVIDIA driver must support it).
# DeepSpeed is installed with DS_BUILD_OPS=0: no CUDA compiler in the image, its CUDA ops are not
# prebuilt (torch_adam is used; ZeRO-Offload's cpu_adam would need one). The cpu target builds the one op
# its CPU training loads (deepspeed_shm_comm, DS_ACCELERATOR=cpu) into DeepSpeed at install time
# (docker/install.sh), so it runs without compilers (the op links torch's libraries and the C++ runtime).
# PID 1 is tini (-g: SIGTERM goes to the whole process group — torchrun's ranks, vLLM's workers), so
# `kubectl delete` and preemption stop a pod at once; the chart sets `args`, never `command`, to keep it.
# Every target runs as the unprivileged user sapd (uid 1000, as in charts/sapd securityContext) from /app.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 sapd \
 && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/sapd --shell /usr/sbin/nologin sapd
WORKDIR /app
# the dependency layers' inputs only: the project metadata, the install script and its pins, and the
# version sapd/__init__.py holds (an empty README stands in for the real one, which pyproject.toml
# names: editing it must not reinstall torch)
COPY pyproject.toml ./
COPY docker/install.sh docker/constraints-cpu.txt docker/constraints-gpu.txt ./docker/
COPY sapd/__init__.py ./sapd/
RUN touch README.md
ENTRYPOINT ["/usr/bin/tini", "-g", "--"]
CMD ["python", "-m", "sapd.cli", "--help"]

FROM base AS cpu-deps
# empty: the default index (on x86 torch's CUDA build); pass the PyTorch CPU wheel index to get the
# small CPU build, or a folder of wheels (WHEELHOUSE, mounted into the build) that holds it
ARG TORCH_INDEX_URL=
ARG WHEELHOUSE=
# TextWorld's jericho is a C source distribution, and DeepSpeed's CPU communication op is compiled in:
# compilers for this one layer, removed in it
RUN apt-get update && apt-get install -y --no-install-recommends build-essential \
 && docker/install.sh cpu \
 && apt-get purge -y --auto-remove build-essential && rm -rf /var/lib/apt/lists/*

FROM base AS gpu-deps
ARG WHEELHOUSE=
RUN docker/install.sh gpu

FROM gpu-deps AS eval-deps
ARG WHEELHOUSE=
# TextWorld's jericho and ALFWorld's planner (fast-downward-textworld, C++ with CMake) are source
# distributions: compilers for this layer only
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
 && docker/install.sh eval \
 && apt-get purge -y --auto-remove build-essential cmake && rm -rf /var/lib/apt/lists/*

FROM cpu-deps AS cpu
COPY README.md ./
COPY sapd ./sapd
RUN pip install --no-deps . \
 && python -c "import sapd, sapd.jobs.teacher_scores, sapd.jobs.train, sapd.jobs.build_prefixes, sapd.jobs.wait, sapd.jobs.check, textworld, bm25s"
USER 1000:1000

FROM gpu-deps AS gpu
COPY README.md ./
COPY sapd ./sapd
RUN pip install --no-deps . \
 && python -c "import sapd, sapd.jobs.teacher_scores, sapd.jobs.train, sapd.jobs.build_prefixes, sapd.jobs.wait, sapd.jobs.check, vllm"
USER 1000:1000

FROM eval-deps AS eval
COPY README.md ./
COPY sapd ./sapd
RUN pip install --no-deps . \
 && python -c "import sapd, sapd.jobs.evaluate, sapd.jobs.check, vllm, textworld, bm25s, alfworld, fast_downward"
USER 1000:1000
