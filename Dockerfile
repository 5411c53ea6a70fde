# megarl GPU image for clusters (first version; issue "Clusters and measured performance" hardens it).
# SGLang pins the torch it runs on: SGLang 0.5.17 <-> torch 2.11 (CUDA 13.0 wheels), so torch comes
# from SGLang's pin, not from requirements.txt (which pins the CPU wheel used in CI).
#   docker build -t megarl:dev .
#   docker run --gpus all --ipc=host megarl:dev --config recipes/llama3_8b_ppo.yaml
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    TORCH_CUDA_ARCH_LIST="8.0;9.0" CUDA_DEVICE_MAX_CONNECTIONS=1
# Distribution package versions are fixed by the base image tag; pinning them here would break on every
# Ubuntu point release.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev git ninja-build build-essential bubblewrap \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/requirements-gpu.txt /tmp/requirements-gpu.txt
RUN pip install pip==25.3 setuptools==80.9.0 wheel==0.45.1 \
    && pip install -r /tmp/requirements-gpu.txt \
    && pip install --no-build-isolation "transformer_engine[pytorch]==2.20.2"
# TE 2.20.2 is the version run on an H200 (parity, a training step, the RL loop on SGLang): it must load torch's
# pip cuDNN, not the base image's, or it fails with an undefined cuDNN symbol at import.
ENV CUDNN_PATH=/opt/venv/lib/python3.12/site-packages/nvidia/cudnn \
    LD_LIBRARY_PATH=/opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib:${LD_LIBRARY_PATH}

RUN useradd --create-home --uid 1000 megarl
WORKDIR /opt/megarl
COPY --chown=megarl:megarl . .
# Builds megarl._C with its CUDA kernels for sm_80 (A100) and sm_90 (H100/H200).
RUN MEGARL_FORCE_CUDA=1 pip install --no-build-isolation --no-deps -e . \
    && python -c "import megarl._C as C; assert C.with_cuda()"

USER 1000:1000
ENTRYPOINT ["torchrun", "--nproc-per-node", "gpu", "megarl/train.py"]
CMD ["--help"]
