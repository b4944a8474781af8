# megatron_bapo on NVIDIA's PyTorch container (CUDA, NCCL, cuDNN, Transformer Engine and Apex included).
#
#   docker build -t megatron-bapo .
#   # SLURM with pyxis/enroot: CONTAINER_IMAGE=megatron-bapo sbatch examples/run_32b_bapo.sh
#
# Two Python environments, on purpose:
#   - the container's own Python runs the Megatron actor: its torch is the build TE and Apex were
#     compiled against, and NGC's pip constraint file (PIP_CONSTRAINT) keeps it from being replaced;
#   - /opt/sglang (a separate venv, SGLANG_PYTHON) runs SGLang and sglang-router, which pin their own
#     torch/flashinfer builds. Installing SGLang next to the actor would swap the torch under TE/Apex.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.5.2
ARG SGLANG_ROUTER_VERSION=0.2.1
ARG MEGATRON_CORE_VERSION=0.16.1

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    SGLANG_PYTHON=/opt/sglang/bin/python

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Rollout side: SGLang + router in their own environment (no NGC constraints apply there).
RUN python -m venv /opt/sglang \
 && PIP_CONSTRAINT="" /opt/sglang/bin/pip install \
      "sglang[srt]==${SGLANG_VERSION}" "sglang-router==${SGLANG_ROUTER_VERSION}" \
 && /opt/sglang/bin/python -c "import sglang, sglang_router"

# Actor side: megatron-core on the container's torch (TE and Apex come with the base image).
RUN pip install "megatron-core==${MEGATRON_CORE_VERSION}" \
 && python -c "import megatron.core, transformer_engine.pytorch, apex"

WORKDIR /workspace/megatron_bapo
COPY . .
RUN pip install './[dev]' \
 && python -c "import megatron_bapo.actor, megatron_bapo.planner, megatron_bapo.sync"

CMD ["python", "tools/plan.py", "--help"]
