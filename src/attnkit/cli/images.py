"""`attnkit images ...`: a cell's wheelhouse, image, report and the smoke gate (promote)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from attnkit._io import write_atomic
from attnkit.cli._args import _Parser
from attnkit.errors import AttnkitError, UsageError


def _cmd_images_wheelhouse(a: argparse.Namespace) -> int:
    from attnkit.images.wheelhouse import build_wheelhouse
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell

    cell = find_cell(load_matrix(a.file), a.cell)
    manifest = build_wheelhouse(cell, Path(a.out), Path(a.wheels) if a.wheels else None, a.index,
                                test_builds=a.test_builds, without=tuple(a.without or ()),
                                platforms=tuple(a.platform or ()))
    files, size, plats = manifest["files"], manifest["bytes"], manifest["platforms"]
    assert isinstance(files, list) and isinstance(size, int) and isinstance(plats, list)
    print(f"{a.out}: {len(files)} wheels ({size / 2**20:.0f} MiB) for {cell.id} on {', '.join(plats)}")
    return 0


def _cmd_images_build(a: argparse.Namespace) -> int:
    from attnkit.images.base import local_base
    from attnkit.images.build import build_image, report_dict
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell

    m = load_matrix(a.file)
    cell = find_cell(m, a.cell)
    base = local_base(m, cell, a.variant, a.platform) if a.local_base else a.base_image
    rep = build_image(m, cell, a.variant, target=a.target, base_image=base, builder=a.builder,
                      context=Path(a.context), platform=a.platform)
    doc = json.dumps(report_dict(rep), indent=1)
    if a.report:
        write_atomic(a.report, doc)
    print(doc)
    size = f"{rep.size_bytes / 2**20:.0f} MiB" if rep.size_bytes else "unknown size"
    print(f"built {rep.tag} ({rep.target}) with {rep.builder} in {rep.seconds:.0f} s: {size}", file=sys.stderr)
    return 0


def _cmd_images_report(a: argparse.Namespace) -> int:
    import tempfile

    from attnkit.images.base import local_base
    from attnkit.images.build import detect_builder
    from attnkit.images.report import full_report
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell

    m = load_matrix(a.file)
    cell = find_cell(m, a.cell)
    base = local_base(m, cell, a.variant) if a.local_base else (a.base_image or cell.base_images[a.variant])
    logs = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="attnkit-image-logs-"))
    rep = full_report(m, cell, a.variant, base_image=base, builder=a.builder or detect_builder(),
                      context=Path(a.context), logs=logs)
    doc = json.dumps(rep, indent=1, default=str)
    if a.out:
        write_atomic(a.out, doc)
    print(doc)
    if rep["problems"]:
        raise AttnkitError(f"images: {cell.id} {a.variant}: {'; '.join(rep['problems'])}")
    return 0


def _cmd_images_promote(a: argparse.Namespace) -> int:
    from attnkit.images.promote import promote
    from attnkit.matrix import load_matrix
    from attnkit.matrix.expand import find_cell

    m = load_matrix(a.file)
    cell = find_cell(m, a.cell)
    variants = a.variant or ["runtime", "devel"]
    if a.push and len(variants) != 1:
        raise UsageError("--push: give exactly one --variant with it (the local image is that variant's)")
    rep = promote(m, cell, variants, tool=a.tool, registry=a.registry, image=a.image,
                  push_local={variants[0]: a.push} if a.push else None, tls_verify=a.tls_verify == "true")
    doc = json.dumps(rep.as_dict(), indent=1)
    if a.report:
        write_atomic(a.report, doc)
    print(doc)
    if not rep.promoted:
        left = [t for ts in rep.moving_tags.values() for t in ts]
        raise AttnkitError(f"images promote: {rep.why_not}; moving tags left where they were: {', '.join(left) or 'none'}")
    moved = [t for ts in rep.moved.values() for t in ts]
    print(f"promoted {cell.id}: smoke {rep.smoke_counts}; {', '.join(moved) or 'no moving tags for this cell'} -> "
          f"{', '.join(sorted(set(rep.digests.values())))}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this module's subcommands to `attnkit`'s parser."""
    im = sub.add_parser("images", help="build a cell's image")
    imsub = im.add_subparsers(dest="images_command", required=True, parser_class=_Parser)
    iw = imsub.add_parser("wheelhouse", help="the hashed, offline wheelhouse an image installs from")
    iw.add_argument("--cell", required=True)
    iw.add_argument("--out", default="wheelhouse")
    iw.add_argument("--wheels", help="verified wheelhouse with the cell's flash-attn/xformers wheels")
    iw.add_argument("--index", help="torch index (default: PyTorch's, for the cell's CUDA or cpu)")
    iw.add_argument("--test-builds", action="store_true", help="accept `wheels build --archs` test builds "
                    "(named '.sm90') where the cell's full wheel is missing; the manifest lists them")
    iw.add_argument("--without", action="append", metavar="PACKAGE", help="leave this package of the cell out "
                    "(repeatable; the manifest records it)")
    iw.add_argument("--platform", action="append", choices=("linux/amd64", "linux/arm64", "all"),
                    help="the image platforms it serves (repeatable; all: the cell's; default: this machine's); "
                    "a multi-platform bake needs all")
    iw.add_argument("--file")
    iw.set_defaults(func=_cmd_images_wheelhouse)
    def image_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--cell", required=True)
        sp.add_argument("--variant", choices=("runtime", "devel"), default="runtime")
        sp.add_argument("--base-image", help="override BASE_IMAGE (e.g. a local base)")
        sp.add_argument("--local-base", action="store_true", help="make and use a base here: Debian (debootstrap), "
                        "for CUDA cells a stand-in for nvidia/cuda (its container environment; the cell's PyPI "
                        "toolkit for devel)")
        sp.add_argument("--builder", choices=("docker", "podman"))
        sp.add_argument("--context", default=".", help="build context holding wheelhouse/ (default: .)")
        sp.add_argument("--file")

    ibd = imsub.add_parser("build", help="build with docker buildx (engine present) or podman")
    image_args(ibd)
    ibd.add_argument("--target", choices=("runtime", "devel", "smoke", "os", "env"),
                     help="Dockerfile stage (default: the variant); 'smoke' runs nox -s smoke in the image")
    ibd.add_argument("--report")
    ibd.add_argument("--platform", choices=("linux/amd64", "linux/arm64"),
                     help="build this platform's image (default: this machine's; another runs under qemu-user-static)")
    ibd.set_defaults(func=_cmd_images_build)
    irp = imsub.add_parser("report", help="build (twice), check inside without a GPU, and report size, layers, "
                           "CUDA libraries, doctor, smoke")
    image_args(irp)
    irp.add_argument("--out", help="write the JSON report here")
    irp.add_argument("--logs", help="keep the build logs here")
    irp.set_defaults(func=_cmd_images_report)

    ipr = imsub.add_parser("promote", help="the smoke gate: (push,) pull by digest, `nox -s smoke` inside, then point "
                           "the cell's moving tags at exactly that digest; a failed smoke moves none (exit 1)")
    ipr.add_argument("--cell", required=True)
    ipr.add_argument("--variant", action="append", choices=("runtime", "devel"),
                     help="repeatable (default: both); the smoke runs in the runtime image")
    ipr.add_argument("--registry", help="default: matrix.yaml publish.registry (e.g. 127.0.0.1:5000/attnkit)")
    ipr.add_argument("--image", help="repository name (default: matrix.yaml publish.image)")
    ipr.add_argument("--tool", choices=("docker", "podman"), default="docker",
                     help="docker (docker run, buildx imagetools) or podman (buildah run, chroot isolation)")
    ipr.add_argument("--push", metavar="LOCAL_IMAGE", help="push this local image to the immutable tag first "
                     "(CI's bake already pushed it)")
    ipr.add_argument("--tls-verify", choices=("true", "false"), default="true",
                     help="podman: false for a plain-HTTP registry on 127.0.0.1")
    ipr.add_argument("--report", help="write the JSON report (tags, digests, smoke counts) here")
    ipr.add_argument("--file")
    ipr.set_defaults(func=_cmd_images_promote)
