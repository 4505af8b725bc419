"""The `docker pull` lines pinned by digest, generated from a rehearsal (or release) report into a marked block
of a doc (docs/usage.md), never written by hand: `python -m attnkit.release.rehearsal --docs docs/usage.md`
writes it, tests/test_release_steps.py checks the block matches the committed report."""

from __future__ import annotations

from typing import Any

BEGIN = "<!-- attnkit-pinned-pulls:begin (generated from the release rehearsal's report; do not edit) -->"
END = "<!-- attnkit-pinned-pulls:end -->"


def pull_block(report: dict[str, Any], source: str) -> str:
    """Markdown lines: each pushed image by tag and by the digest the registry gave it, and its moving tags."""
    pushed = report["pushed"]
    reg = report["registry"]["address"]
    lines = [f"Pushed by the release rehearsal of {report['date']} to a local registry ({reg}; `{source}`), each "
             "tag with the digest it names there; a release's `attnkit images promote --report` gives the same for "
             "ghcr.io:", ""]
    for variant, tag in sorted(pushed["immutable"].items()):
        lines.append(f"- `docker pull {tag}`  ")
        lines.append(f"  `docker pull {pushed['docker_pull_pinned'][variant].removeprefix('docker pull ')}`  ")
        moved = pushed["moved"].get(variant) or []
        lines.append(f"  moving tag{'s' if len(moved) != 1 else ''} at the same digest after its smoke passed: "
                     + (", ".join(f"`{t.rsplit(':', 1)[1]}`" for t in moved) or "none"))
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"no generated-block markers ({BEGIN} ... {END})")
    return text[: begin + len(BEGIN)] + "\n" + block + "\n" + text[end:]
