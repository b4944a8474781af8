# megatron_bapo on NVIDIA's PyTorch container, with SGLang and the Megatron actor in ONE environment.
#
#   docker build $(sed -n 's/^\([A-Z_]*\)=\(.*\)/--build-arg \1=\2/p' pins.env) -t megatron-bapo .
#   # SLURM with pyxis/enroot: CONTAINER_IMAGE=megatron-bapo sbatch examples/run_32b_bapo.sh
#
# Every version is in pins.env (the ARG defaults below repeat it; the command above passes the file).
#
# One environment, on purpose: the distributed weight sync puts trainer rank 0 and every SGLang TP
# rank in one NCCL communicator, and NCCL refuses ranks that run different NCCL versions. SGLang pins
# its own torch (and through it its NCCL wheel), so /opt/venv is SGLang's resolved environment and
# the actor runs in it too: Transformer Engine is built there against that torch (the base image
# gives the CUDA toolkit, cuDNN and compilers; its own torch is not used by either side), then
# megatron-core and this project. The build records that environment's NCCL version
# (SGLANG_NCCL_VERSION), which the trainer compares with its own before joining the weight group.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.5.23
ARG TORCH_VERSION=2.14.1
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG MEGATRON_CORE_VERSION=0.16.1
ARG TRANSFORMER_ENGINE_VERSION=2.20.2
ARG TRANSFORMER_ENGINE_CUDA=cu13

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    SGLANG_PYTHON=/opt/venv/bin/python

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# SGLang, its router and the torch/NCCL it pins: the environment both sides run in. NGC's pip
# constraint file (which pins the base image's torch) does not apply to this venv.
# torch is named with the version SGLang pins (pins.env): a new SGLang pinning another one fails here.
RUN python -m venv /opt/venv \
 && PIP_CONSTRAINT="" pip install "sglang==${SGLANG_VERSION}" "sglang-router==${SGLANG_ROUTER_VERSION}" \
      "torch==${TORCH_VERSION}" \
 && python -c "import sglang, sglang_router, torch; assert torch.cuda.nccl.version()"

# The actor side in the same environment: TE built against this torch, then megatron-core.
# Mixture-of-experts models (Qwen3-MoE) need nothing more: their experts run TE's grouped GEMM
# (megatron's TEGroupedMLP over transformer_engine.pytorch.GroupedLinear; megatron's legacy
# GroupedMLP and its `grouped_gemm` package are not used), checked by the import below.
#
# Deterministically: TE's core library is its pinned prebuilt wheel for CUDA 13 (the image's and torch's
# CUDA major), and the PyTorch extension (transformer_engine_torch, a source distribution on PyPI) is
# compiled from source against /opt/venv's torch. NVTE_PYTORCH_FORCE_BUILD=TRUE skips the extension's
# CachedWheelsCommand, which would otherwise download a prebuilt wheel keyed on its guess of the
# torch/CUDA/ABI triple from GitHub releases; NGC's own variables (NVIDIA_PRODUCT_NAME=PyTorch, the pip
# constraint pinning NGC's torch) are cleared for the build, so nothing depends on the base image's
# Python environment. `torch==` keeps pip from swapping torch while it resolves TE's requirements.
# tools/check_image_pins.py (run by CI without Docker) resolves this whole set for Python 3.12 x86-64.
RUN env -u NVIDIA_PRODUCT_NAME NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE PIP_CONSTRAINT="" \
      pip install --no-build-isolation --no-binary transformer-engine-torch "torch==${TORCH_VERSION}" \
      "transformer-engine==${TRANSFORMER_ENGINE_VERSION}" \
      "transformer-engine-${TRANSFORMER_ENGINE_CUDA}==${TRANSFORMER_ENGINE_VERSION}" \
      "transformer-engine-torch==${TRANSFORMER_ENGINE_VERSION}" \
 && PIP_CONSTRAINT="" pip install "megatron-core==${MEGATRON_CORE_VERSION}" "torch==${TORCH_VERSION}" \
 && python -c "import megatron.core, torch, transformer_engine.pytorch; from transformer_engine.pytorch import GroupedLinear; \
assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

WORKDIR /workspace/megatron_bapo
COPY . .
RUN PIP_CONSTRAINT="" pip install './[dev]' "torch==${TORCH_VERSION}" \
 && python -c "import megatron_bapo.actor, megatron_bapo.planner, megatron_bapo.sync.export" \
 && python -c "import torch; print('.'.join(map(str, torch.cuda.nccl.version())))" > /opt/venv/sglang_nccl_version

# The NCCL the SGLang servers run (the same environment as the actor): the weight-group check reads it.
ENV SGLANG_NCCL_VERSION_FILE=/opt/venv/sglang_nccl_version
CMD ["python", "tools/plan.py", "--help"]
