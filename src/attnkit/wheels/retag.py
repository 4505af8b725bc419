"""Give a freshly built wheel its published identity: the local version from the naming module
(`+cu13torch2.11cxx11abiTRUE`) and a torch requirement pinned to the cell's major.minor, so pip refuses
it next to another torch instead of failing later with "undefined symbol"."""

from __future__ import annotations

import base64
import hashlib
import re
import zipfile
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from attnkit.errors import AttnkitError


def torch_pin(torch_minor: str) -> str:
    major, minor = (int(x) for x in torch_minor.split("."))
    return f"torch<{major}.{minor + 1},>={major}.{minor}"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _rewrite_metadata(text: str, version: str, torch_minor: str) -> str:
    out, pinned = [], False
    for line in text.splitlines():
        if line.startswith("Version:"):
            line = f"Version: {version}"
        elif line.startswith("Requires-Dist:"):
            try:
                req = Requirement(line.split(":", 1)[1].strip())
            except InvalidRequirement:
                req = None
            if req is not None and req.name.lower() == "torch":
                if pinned:
                    continue
                line, pinned = f"Requires-Dist: {torch_pin(torch_minor)}", True
        out.append(line)
    if not pinned:  # insert after the last header line before the body
        at = next((i for i, ln in enumerate(out) if ln == ""), len(out))
        out.insert(at, f"Requires-Dist: {torch_pin(torch_minor)}")
    return "\n".join(out) + "\n"


def retag(src: Path, dest_dir: Path, filename: str, torch_minor: str) -> Path:
    """Rewrite `src` as dest_dir/filename (whose version carries the local part). Written to a temporary
    name and renamed, so dest_dir never holds a half-written wheel."""
    name, version, _, tags = parse_wheel_filename(filename)
    sname, sversion, _, stags = parse_wheel_filename(src.name)
    if sname != name:
        raise AttnkitError(f"retag: built wheel {src.name} is not {name}")
    if stags != tags:
        have = ",".join(sorted(str(t) for t in stags))
        want = ",".join(sorted(str(t) for t in tags))
        raise AttnkitError(f"retag: built wheel is tagged {have}, the cell needs {want}")
    if Version(str(version)).public != sversion.public:
        raise AttnkitError(f"retag: built version {sversion} is not {Version(str(version)).public}")
    raw_version = filename.split("-")[1]  # as named (packaging would lower-case the local part)
    old_info = re.compile(rf"^{re.escape(src.name.split('-')[0])}-[^/]+\.dist-info/")
    new_info = f"{filename.split('-')[0]}-{raw_version}.dist-info/"
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest_dir / f".{filename}.tmp"
    records = []
    try:
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                arc = old_info.sub(new_info, info.filename)
                if arc.endswith(".dist-info/RECORD"):
                    continue
                data = zin.read(info)
                if arc == new_info + "METADATA":
                    data = _rewrite_metadata(data.decode("utf-8"), raw_version, torch_minor).encode("utf-8")
                zi = zipfile.ZipInfo(arc, date_time=info.date_time)
                zi.external_attr = info.external_attr
                zi.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(zi, data)
                records.append(_record_line(arc, data))
            records.append(f"{new_info}RECORD,,")
            zout.writestr(new_info + "RECORD", "\n".join(records) + "\n")
        final = dest_dir / filename
        tmp.replace(final)
        return final
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_metadata(wheel: Path) -> dict[str, list[str]]:
    """METADATA headers of a wheel, multi-valued."""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if meta is None:
            raise AttnkitError(f"{wheel.name}: no .dist-info/METADATA")
        msg = HeaderParser().parsestr(z.read(meta).decode("utf-8"))
    out: dict[str, list[str]] = {}
    for k, v in msg.items():
        out.setdefault(k, []).append(v)
    return out
