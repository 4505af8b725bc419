"""One exception type for every user-facing error, so the CLI can print it as one line."""

from __future__ import annotations

import re


class AttnkitError(Exception):
    """An error a user can fix; its message is one line that names the input and what is allowed."""

    exit_code = 1  # what the command exits with: a failure (a bad file, a missing tool, a wheel that does not fit)

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(AttnkitError):
    """The command line itself is wrong (a missing, malformed or unknown argument value)."""

    exit_code = 2  # like argparse


def torch_import_failure(error: str) -> str:
    """A one-line diagnosis of why an installed torch does not import: the broken library or symbol, and what
    usually causes it. `error` is "ExceptionType: message" from the failed `import torch`."""
    import re

    first = (error.strip().splitlines() or ["unknown error"])[0][:300]
    lib = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file", first)
    if lib:
        return (f"torch is installed but does not import: {lib.group(1)} is missing ({first}); likely cause: the "
                "CUDA/cuDNN libraries torch was built against are not installed (reinstall torch with its nvidia-* "
                "dependencies, or use the torch build for your CUDA)")
    sym = re.search(r"undefined symbol: (\S+)", first)
    if sym:
        return (f"torch is installed but does not import: undefined symbol {sym.group(1)} ({first}); likely cause: a "
                "library built for another torch or CUDA version (torch/CUDA mismatch, or an extension wheel built "
                "for another torch)")
    return f"torch is installed but does not import: {first}"


def shown(name: object) -> str:
    """A user-given name (a path, a value) as it can be shown inside one line: as it is, or repr()'d when it
    holds a newline or another character that is not printable."""
    text = str(name)
    return text if text.isprintable() else repr(text)


def first_line(text: object, limit: int = 200) -> str:
    """The first non-empty line of a message (an exception's str), cut to `limit`: errors stay one line."""
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")[:limit]


OOM = re.compile(r"out of memory|ALLOC_FAILED", re.IGNORECASE)  # torch's, CUDA's, cuDNN's and cuBLAS's words


def out_of_memory(exc: BaseException | str) -> bool:
    """An allocation that failed: MemoryError, torch.OutOfMemoryError (a RuntimeError, known by its text), a CUDA
    error or a cuDNN / cuBLAS status saying so; or a candidate's recorded error (timer.warm's text) that does."""
    return isinstance(exc, MemoryError) or bool(OOM.search(str(exc)))
