"""Give a freshly built wheel its published identity: the local version from the naming module
(`+cu13torch2.11cxx11abiTRUE`) and a torch requirement pinned to the cell's major.minor, so pip refuses
it next to another torch instead of failing later with "undefined symbol".

The wheel is read and written through `wheel`'s WheelFile (pypa/wheel, the library behind `wheel unpack` and
`wheel pack`): every file is checked against the old RECORD as it is read, and RECORD is written anew. The
`.dist-info/` and `.data/` folders are renamed to the new version; METADATA's header block is edited, its
body (the long description) is copied byte for byte."""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path
from zipfile import ZipInfo

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from wheel.wheelfile import WheelError, WheelFile

from attnkit.errors import AttnkitError


def torch_pin(torch_minor: str) -> str:
    major, minor = (int(x) for x in torch_minor.split("."))
    return f"torch<{major}.{minor + 1},>={major}.{minor}"


def _split_headers(raw: bytes) -> tuple[list[bytes], bytes]:
    """METADATA as (header lines, the rest from the blank line on). The body is never parsed."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        at = raw.find(sep)
        if at >= 0:
            return raw[:at].splitlines(), raw[at:]
    return raw.rstrip(b"\r\n").splitlines(), b"\n"


def _header_name(line: bytes) -> str | None:
    """'Version' for b'Version: 1.0'; None for a continuation line (starts with whitespace)."""
    if line[:1] in (b" ", b"\t") or b":" not in line:
        return None
    return line.split(b":", 1)[0].decode("utf-8").strip().lower()


def rewrite_metadata(raw: bytes, version: str, torch_minor: str, requirement: str | None = None) -> bytes:
    """Set Version and make the one torch requirement `torch_pin(torch_minor)` (or `requirement`: a stable-ABI
    wheel's floor, 'torch>=2.9'), in the header block only."""
    lines, body = _split_headers(raw)
    out: list[bytes] = []
    pinned, skip_continuation = False, False
    pin = f"Requires-Dist: {requirement or torch_pin(torch_minor)}".encode()
    for line in lines:
        name = _header_name(line)
        if name is None:
            if not skip_continuation:
                out.append(line)
            continue
        skip_continuation = False
        if name == "version":
            out.append(f"Version: {version}".encode())
            continue
        if name == "requires-dist":
            try:
                req: Requirement | None = Requirement(line.split(b":", 1)[1].decode("utf-8").strip())
            except InvalidRequirement:
                req = None
            if req is not None and canonicalize_name(req.name) == "torch":
                if not pinned:
                    out.append(pin)
                    pinned = True
                skip_continuation = True
                continue
        out.append(line)
    if not pinned:
        out.append(pin)
    eol = b"\r\n" if b"\r\n" in raw[:200] else b"\n"
    return eol.join(out) + body


def retag(src: Path, dest_dir: Path, filename: str, torch_minor: str, requirement: str | None = None) -> Path:
    """Rewrite `src` as dest_dir/filename (whose version carries the local part). Written to a temporary
    name and renamed, so dest_dir never holds a half-written wheel. `requirement` replaces the torch pin of
    `torch_minor` (a stable-ABI wheel requires a floor)."""
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
    new_prefix = f"{filename.split('-')[0]}-{raw_version}"
    dest_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".retag-", dir=dest_dir))
    tmp = stage / filename  # WheelFile takes the RECORD path from the file's name
    try:
        with WheelFile(src) as zin, WheelFile(tmp, "w") as zout:
            old_prefix = zin.dist_info_path.removesuffix(".dist-info")
            for info in zin.infolist():
                top, _, rest = info.filename.partition("/")
                if top == f"{old_prefix}.dist-info":
                    if rest == "RECORD":
                        continue  # WheelFile writes the new one on close
                    top = f"{new_prefix}.dist-info"
                elif top == f"{old_prefix}.data":
                    top = f"{new_prefix}.data"
                arc = f"{top}/{rest}" if rest or info.filename.endswith("/") else top
                data = zin.read(info)  # checked against the old RECORD
                if arc == f"{new_prefix}.dist-info/METADATA":
                    data = rewrite_metadata(data, raw_version, torch_minor, requirement)
                zi = ZipInfo(arc, date_time=info.date_time)
                zi.external_attr = info.external_attr
                zi.compress_type = zout.compression
                zout.writestr(zi, data)
        final = dest_dir / filename
        tmp.replace(final)
        return final
    except (WheelError, zipfile.BadZipFile) as exc:
        raise AttnkitError(f"retag: {src.name}: {exc}") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def read_metadata(wheel: Path) -> dict[str, list[str]]:
    """METADATA headers of a wheel, multi-valued."""
    return parse_metadata(metadata_bytes(wheel))


def parse_metadata(raw: bytes) -> dict[str, list[str]]:
    msg = HeaderParser().parsestr(raw.decode("utf-8"))
    out: dict[str, list[str]] = {}
    for k, v in msg.items():
        out.setdefault(k, []).append(v)
    return out


MAX_METADATA = 4 * 2**20  # flash-attn's METADATA is ~10 KiB; torch's, with its long description, ~50 KiB


def metadata_bytes(wheel: Path) -> bytes:
    """The wheel's .dist-info/METADATA exactly as stored: what an index serves as `<wheel>.metadata` (PEP 658)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if meta is None:
            raise AttnkitError(f"{wheel.name}: no .dist-info/METADATA")
        size = z.getinfo(meta).file_size  # as declared; a zip bomb declares its real size or fails the read below
        if size > MAX_METADATA:
            raise AttnkitError(f"{wheel.name}: its METADATA is {size} bytes (at most {MAX_METADATA}: a package's "
                               "metadata is a few KiB)")
        with z.open(meta) as f:
            data = f.read(MAX_METADATA + 1)
        if len(data) > MAX_METADATA:
            raise AttnkitError(f"{wheel.name}: its METADATA inflates past {MAX_METADATA} bytes")
        return data
