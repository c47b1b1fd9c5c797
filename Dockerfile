# The image a Kubernetes TrainJob runs (`python -m toolkit launch --on kubernetes --image IMAGE ...`): this
# repository in /finetune, the working directory the node command runs in, with its .venv (`make install-node`).
# The node command calls .venv/bin/python itself; PATH has the venv first too, so `python` in a shell is its.
#
#   docker build -t ghcr.io/you/finetune:1 . && docker push ghcr.io/you/finetune:1
#
# torch's wheels from PyPI carry their CUDA libraries; the node's NVIDIA container runtime gives the driver.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends make g++ git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /finetune
COPY . .
RUN make install-node && rm -rf /root/.cache/pip
ENV PATH=/finetune/.venv/bin:$PATH
