"""`attnkit index build|key`, `wheel-url`, `install`: the wheel site and what a user installs from it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnkit.cli._args import _Parser, minor_version
from attnkit.errors import AttnkitError, UsageError


def _cmd_index_build(a: argparse.Namespace) -> int:
    from attnkit.matrix import load_matrix
    from attnkit.wheels.index import build_index

    entries = build_index(Path(a.dir), Path(a.out), a.base_url, a.site_url, matrix=load_matrix(a.file))
    print(f"{a.out}: indexed {len({e.filename for e in entries})} wheel(s) of {len({e.project for e in entries})} "
          f"project(s) in "
          f"{len({e.key for e in entries})} index(es) (one per key), {len({e.cell for e in entries})} cell page(s)")
    return 0




def _default_site(a: argparse.Namespace) -> str:
    if a.index:
        return str(a.index)
    from attnkit.matrix import load_matrix

    return load_matrix(None).publish.wheel_site


def _chosen(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    from attnkit.wheels import pyenv
    from attnkit.wheels.resolve import choose, index_url, listing, stable_listing

    source = "--index"
    if not a.index:  # attnkit's own site: only the matrix's packages are there; say so before any network
        from attnkit.matrix import load_matrix

        known = sorted(load_matrix(None).packages)
        if a.package not in known:
            raise UsageError(f"package: {a.package!r} is not built by attnkit (its site has {', '.join(known)}); "
                             "pass --index SITE for another wheel site")
        source = "the default wheel site (matrix.yaml publish.wheel_site; it may not be published yet; --index SITE)"
    env = pyenv.describe(a.python)
    site = _default_site(a)
    simple = index_url(site, env)
    stable = stable_listing(site, a.package)  # the site's stable-ABI wheels: they may serve a key with no page
    try:
        cands = listing(simple, a.package, source)
    except AttnkitError:
        if not stable:
            raise
        cands = []
    return env, simple, choose(cands, env, a.package, stable)


def _cmd_wheel_url(a: argparse.Namespace) -> int:
    from attnkit.wheels.index import install_commands

    _, simple, c = _chosen(a)
    print(f"{c.url}#sha256={c.sha256}" if c.sha256 else c.url)
    for tool, cmd in install_commands(simple, a.package, c.version.public).items():
        print(f"{tool + ':':4} {cmd}", file=sys.stderr)
    return 0


def _cmd_install(a: argparse.Namespace) -> int:
    from attnkit.wheels.resolve import install

    env, _, c = _chosen(a)
    tool = install(c, a.package, env, deps=not a.no_deps)
    print(f"installed {c.filename} (sha256 {c.sha256}) with {tool}; torch stays {env.torch}")
    return 0


def _cmd_index_key(a: argparse.Namespace) -> int:
    from attnkit.matrix import naming

    if a.torch is None and a.cuda is None:
        from attnkit.wheels import pyenv

        print(pyenv.describe(a.python).index_key())
        return 0
    if a.torch is None or a.cuda is None:
        raise UsageError("index key: give both --torch X.Y and --cuda X.Y (or neither: the key of --python's torch)")
    abi = a.abi
    if abi is None:
        from attnkit.matrix import load_matrix

        rel = load_matrix(a.file).torch.get(a.torch)
        if rel is None:
            raise UsageError(f"--torch {a.torch}: not in the matrix; pass --abi TRUE|FALSE")
        abi = "TRUE" if rel.cxx11_abi else "FALSE"
    print(naming.index_key(a.cuda, a.torch, abi == "TRUE"))
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add this module's subcommands to `attnkit`'s parser."""
    ix = sub.add_parser("index", help="the wheel site: one PEP 503 index per environment key")
    isub = ix.add_subparsers(dest="index_command", required=True, parser_class=_Parser)
    ib = isub.add_parser("build", help="write SITE/<key>/simple/ per key, a find-links page per cell, a landing page")
    ib.add_argument("dir", help="wheelhouse with verified wheels")
    ib.add_argument("--out", default="site")
    ib.add_argument("--base-url", help="link wheels here (e.g. release assets) instead of copying them; upload "
                    "SITE/files/*.metadata there too")
    ib.add_argument("--site-url", help="where the site is served (absolute URLs on the landing page)")
    ib.add_argument("--file", help="matrix file: its torch releases are the keys a stable-ABI wheel is listed under")
    ib.set_defaults(func=_cmd_index_build)
    ik = isub.add_parser("key", help="the index key of an environment (default: --python's torch)")
    ik.add_argument("--python", default=sys.executable, help="interpreter whose torch decides (default: this one)")
    ik.add_argument("--torch", metavar="X.Y", type=minor_version("2.11"), help="instead: torch major.minor ...")
    ik.add_argument("--cuda", metavar="X.Y", type=minor_version("13.0"), help="... and its CUDA")
    ik.add_argument("--abi", choices=("TRUE", "FALSE"), help="C++11 ABI (default: the matrix's, for --torch)")
    ik.add_argument("--file", help="matrix file (for the default --abi)")
    ik.set_defaults(func=_cmd_index_key)


    for name, func, text in (("wheel-url", _cmd_wheel_url, "print the URL of the wheel that fits this environment "
                                                           "(and the pip / uv commands, on stderr)"),
                             ("install", _cmd_install, "install the wheel that fits, hash-checked, with its "
                                                       "dependencies; torch is never changed")):
        sp = sub.add_parser(name, help=text)
        sp.add_argument("package", help="the project to find: flash-attn or xformers on attnkit's site (any project "
                                        "on a site given with --index)")
        sp.add_argument("--index", help="a wheel site (URL or folder; its <key>/simple is used) or one simple index "
                        "(ends in /simple); default: matrix.yaml publish.wheel_site")
        sp.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
        if name == "install":
            sp.add_argument("--no-deps", action="store_true", help="install the wheel alone")
        sp.set_defaults(func=func)
