"""What a built image is, checked from inside it without a GPU (buildah run): who it runs as, its labels, what
it carries (CUDA libraries: one copy each; compilers and pip: none in runtime, nvcc in devel), what attnkit's
doctor sees there, and its size against base + Python + environment. `attnkit images report` builds the
image twice (first build, then a no-change rebuild), its `os` stage (base + Python), and for runtime the
`smoke` stage (`nox -s smoke` inside), and writes all of it as one JSON report."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from attnkit.images import build as ib
from attnkit.matrix.expand import Cell
from attnkit.matrix.schema import Matrix

# The CUDA libraries an image could carry twice (a base image's copy and torch's wheels' copy).
CUDA_LIBS = ("libcudart.so", "libcublas.so", "libcublasLt.so", "libcudnn.so", "libnvrtc.so", "libcufft.so",
             "libcusparse.so", "libnccl.so")
TOOLS = ("gcc", "cc", "c++", "g++", "clang", "nvcc", "make", "pip", "pip3")

# A CUDA kernel compiled and loaded by torch's own extension builder: what a devel image is for.
_EXTENSION_CHECK = r"""
import torch, torch.utils.cpp_extension as ce, tempfile
src = '__global__ void k(float* x) { x[threadIdx.x] += 1.0f; }\nvoid launch(torch::Tensor x) { k<<<1, x.numel()>>>(x.data_ptr<float>()); }'
mod = ce.load_inline('attnkit_devel_check', cpp_sources='void launch(torch::Tensor x);', cuda_sources=src,
                     functions=['launch'], build_directory=tempfile.mkdtemp(), verbose=False)
print('built and loaded', mod.__file__)
"""


# Can FlashAttention-4's kernel cache be filled while the image is built (no GPU there)? Its arch override
# (FLASH_ATTENTION_ARCH) picks the kernel variant; the call itself still has to get CUDA tensors.
_FA4_WITHOUT_GPU = r"""
import os
os.environ.update(FLASH_ATTENTION_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
import torch
from flash_attn.cute import flash_attn_func
q = torch.randn(1, 128, 4, 64, dtype=torch.bfloat16)
try:
    flash_attn_func(q, q, q, causal=True)
    print("compiled without a GPU")
except Exception as exc:
    print("no: %s: %s" % (type(exc).__name__, exc))
"""


def family(path: str) -> str | None:
    """'libcublasLt.so' for '/x/libcublasLt.so.13.1.0.3'; None for a library that is not a CUDA one."""
    name = path.rsplit("/", 1)[-1]
    return next((lib for lib in sorted(CUDA_LIBS, key=len, reverse=True) if name.startswith(lib)), None)


def duplicate_cuda_libs(paths: list[str]) -> dict[str, list[str]]:
    """CUDA libraries present in more than one folder (a second copy of libcudart, cuBLAS, cuDNN ...)."""
    by: dict[str, set[str]] = defaultdict(set)
    for p in paths:
        fam = family(p)
        if fam:
            by[fam].add(p.rsplit("/", 1)[0])
    return {fam: sorted(dirs) for fam, dirs in sorted(by.items()) if len(dirs) > 1}


def inside(ref: str, variant: str) -> dict[str, Any]:
    """Checks from inside the image; each item says what it found, `problems` what is wrong."""
    problems: list[str] = []
    info = json.loads(subprocess.run(["podman", "image", "inspect", ref], capture_output=True, text=True,
                                     check=True).stdout)[0]
    uid = ib.run_in_image(ref, "id", "-u").stdout.strip()
    if uid == "0":
        problems.append("runs as root")
    found = ib.run_in_image(ref, "sh", "-c", "find / -xdev \\( " + " -o ".join(f"-name '{lib}*'" for lib in CUDA_LIBS)
                 + " \\) \\( -type f -o -type l \\) 2>/dev/null").stdout.split()
    dups = duplicate_cuda_libs(found)
    if dups and variant == "runtime":  # devel carries the toolkit's own copies on purpose (to link against)
        problems.append(f"CUDA libraries in more than one place: {dups}")
    tools = ib.run_in_image(ref, "sh", "-c", "for t in " + " ".join(TOOLS) + "; do command -v $t; done").stdout.split()
    pip = ib.run_in_image(ref, "python", "-m", "pip", "--version")
    if variant == "runtime" and (tools or pip.returncode == 0):
        problems.append(f"build tools in the runtime image: {tools or ['pip (python -m pip)']}")
    doctor = ib.run_in_image(ref, "python", "-m", "attnkit.cli", "doctor", "--json")
    try:
        doc = json.loads(doctor.stdout)
    except ValueError:
        doc = None
        problems.append(f"attnkit doctor --json failed: {(doctor.stderr.strip().splitlines() or ['?'])[-1]}")
    out: dict[str, Any] = {
        "ref": ref, "user": info.get("User") or info.get("Config", {}).get("User"), "uid": uid,
        "labels": info.get("Labels") or {}, "env": info.get("Env") or info.get("Config", {}).get("Env"),
        "cuda_libraries": sorted(p for p in found if family(p)), "duplicate_cuda_libraries": dups,
        "tools_on_path": tools, "pip_runs": pip.returncode == 0, "doctor": doc,
    }
    libs = {lib["name"]: lib for lib in (doc or {}).get("probe", {}).get("libraries", [])}
    if libs.get("flash-attn-4", {}).get("loads"):
        fa4 = ib.run_in_image(ref, "python", "-c", _FA4_WITHOUT_GPU)
        said = (fa4.stdout.strip().splitlines() or [fa4.stderr.strip()[-200:]])[-1]
        out["fa4_kernel_cache_at_build"] = {"possible": said == "compiled without a GPU", "said": said}
    if variant == "devel":
        if "nvcc" not in " ".join(tools) or "/usr/bin/g++" not in tools:
            problems.append(f"the devel image lacks nvcc or g++ (found {tools})")
        if pip.returncode != 0:
            problems.append("no pip in the devel image")
        t0 = time.monotonic()
        ext = ib.run_in_image(ref, "env", "TORCH_CUDA_ARCH_LIST=9.0", "python", "-c", _EXTENSION_CHECK)  # no GPU to ask
        out["extension_build"] = {"ok": ext.returncode == 0, "seconds": round(time.monotonic() - t0, 1),
                                  "output": (ext.stdout + ext.stderr).strip().splitlines()[-3:]}
        if ext.returncode != 0:
            problems.append(f"a CUDA extension does not build inside: {out['extension_build']['output']}")
    out["problems"] = problems
    return out


def smoke_counts(log: str) -> dict[str, int] | None:
    """The outcome counts the smoke stage prints ('smoke {'passed': 12, 'skipped': 30}')."""
    import ast

    m = re.search(r"smoke (\{.*\})", log)
    return ast.literal_eval(m.group(1)) if m else None


def full_report(m: Matrix, cell: Cell, variant: str, *, base_image: str, builder: str, context: Path,
                logs: Path) -> dict[str, Any]:
    logs.mkdir(parents=True, exist_ok=True)
    first = ib.build_image(m, cell, variant, base_image=base_image, builder=builder, context=context,
                           log=logs / f"{variant}-first.log")
    again = ib.build_image(m, cell, variant, base_image=base_image, builder=builder, context=context,
                           log=logs / f"{variant}-rebuild.log")
    os_stage = ib.build_image(m, cell, variant, target="os", base_image=base_image, builder=builder,
                              context=context, tag=f"localhost/attnkit:{cell.id}-{variant}-os")
    base_size = ib.image_size(builder, base_image)
    venv = int(ib.run_in_image(first.tag, "du", "-sb", "/opt/venv").stdout.split()[0])
    # devel adds its own layers (compilers, headers, pip and build tools) on top of the runtime environment
    extra = sum(h["size"] or 0 for h in first.history if "g++" in h["created_by"] or "devel/requirements" in h["created_by"])
    rep: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "cell": cell.id, "variant": variant, "builder": f"{builder}",
        "base_image": base_image, "tag": first.tag,
        "first_build_seconds": first.seconds, "rebuild_seconds": again.seconds, "rebuild_cache_hits": again.cache_hits,
        "image_bytes": first.size_bytes,
        "layer_groups": {"base image": base_size,
                         "os stage: distro Python + user": (os_stage.size_bytes or 0) - (base_size or 0),
                         "environment (/opt/venv)": venv,
                         **({"devel: g++, Python headers, pip, build tools": extra} if variant == "devel" else {})},
        "size_over_base_python_env": (first.size_bytes or 0) / ((os_stage.size_bytes or 0) + venv + extra),
        "history": first.history,
    }
    if rep["size_over_base_python_env"] > 1.05:
        rep.setdefault("problems", []).append("image is more than 5% over base + Python + environment (+ devel tools)")
    if variant == "runtime":
        smoke = ib.build_image(m, cell, variant, target="smoke", base_image=base_image, builder=builder,
                               context=context, tag=f"localhost/attnkit:{cell.id}-smoke", log=logs / "smoke.log")
        rep["smoke_counts"] = smoke_counts((logs / "smoke.log").read_text())
        rep["smoke_build_seconds"] = smoke.seconds
    checks = inside(first.tag, variant)
    rep["inside"] = checks
    rep["problems"] = rep.get("problems", []) + checks.pop("problems")
    return rep
