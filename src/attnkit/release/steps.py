"""The release path as a list of attnkit commands: what release.yml and images.yml run on a tag, and what
`nox -s release-rehearsal` runs here. A step with a `workflow` is the SAME command in both places (same
subcommand, same options; tests/test_release_steps.py parses the workflows and checks it, both ways); its
`local_only` options are the few the rehearsal adds because its machine differs, each with the reason. A step
without a workflow stands for what the workflow does with a tool this machine lacks (`stands_for`), or is the
user's side, taken from the documented install commands.

Placeholders `{name}` in `argv` are filled by `render`.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    workflow: str | None = None  # .github/workflows/<file>
    job: str | None = None
    local_only: dict[str, str] = field(default_factory=dict)  # option -> why only the rehearsal passes it
    stands_for: str | None = None  # for a rehearsal-only step: what the release does instead

    @property
    def command(self) -> tuple[str, ...]:
        """The subcommand words: ('index', 'build')."""
        words = []
        for tok in self.argv[1:]:
            if tok.startswith("-") or "{" in tok or "/" in tok:
                break
            words.append(tok)
        return tuple(words)

    @property
    def options(self) -> set[str]:
        return {t.split("=", 1)[0] for t in self.argv if t.startswith("--")}


STEPS: tuple[Step, ...] = (
    Step("wheel", ("attnkit", "wheels", "build", "--recipe", "{recipe}", "--cell", "{wheel_cell}", "--python",
                   "{python}", "--toolkit", "pypi", "--out", "{wheelhouse}", "--build-dir", "{build_dir}"),
         stands_for="wheels.yml: flash-attn and xformers built per cell (hours per wheel); here the tiny CUDA extension "
                    "of tests/fixtures/tinyext through the same driver, verification and naming (minutes)"),
    Step("site", ("attnkit", "index", "build", "{wheelhouse}", "--out", "{site}", "--base-url", "{base_url}",
                  "--site-url", "{site_url}"),
         workflow="release.yml", job="publish"),
    # --platform: `all` in images.yml (its bake pushes every platform of the cell's manifest); the rehearsal, which
    # builds and smoke-tests one image here, passes this machine's
    Step("image-wheelhouse", ("attnkit", "images", "wheelhouse", "--cell", "{cell}", "--out", "{context}/wheelhouse",
                              "--platform", "{platform}", "--index", "{torch_index}"),
         workflow="images.yml", job="build",
         local_only={"--index": "PyTorch's index (the default) where download.pytorch.org resolves; where it does not "
                                "(the 2-core machine) PyPI, with the CPU torch from pip's find-links folder"}),
    Step("image-build", ("attnkit", "images", "build", "--cell", "{cell}", "--builder", "podman", "--local-base",
                         "--context", "{context}"),
         stands_for="images.yml: `docker buildx bake --push` of the same Dockerfile and build args (no Docker engine "
                    "here; attnkit images build runs podman, or that bake with --builder docker)"),
    Step("promote", ("attnkit", "images", "promote", "--cell", "{cell}", "--variant", "runtime", "--tool", "podman",
                     "--registry", "{registry}", "--push", "{local_image}", "--tls-verify", "false",
                     "--report", "{report}"),
         workflow="images.yml", job="smoke-promote",
         local_only={"--push": "CI's bake already pushed the immutable tag",
                     "--registry": "the local registry on 127.0.0.1 instead of matrix.yaml's publish.registry",
                     "--tls-verify": "that registry speaks plain HTTP"}),
    Step("promote-failing", ("attnkit", "images", "promote", "--cell", "{cell}", "--variant", "runtime", "--tool",
                             "podman", "--registry", "{failing_registry}", "--push", "{failing_image}",
                             "--tls-verify", "false", "--report", "{failing_report}"),
         stands_for="the promote step (same command) on an image made to fail its smoke: it must exit 1 and move "
                    "no tag"),
)


def step(name: str) -> Step:
    for s in STEPS:
        if s.name == name:
            return s
    raise KeyError(name)


def render(name: str, **values: str) -> list[str]:
    """The step's argv with its placeholders filled; a missing value is an error naming it."""
    out = []
    for tok in step(name).argv:
        fields = [f for _, f, _, _ in string.Formatter().parse(tok) if f]
        missing = [f for f in fields if f not in values]
        if missing:
            raise KeyError(f"step {name}: no value for {', '.join(missing)}")
        out.append(tok.format(**values))
    return out


# The workflows of the release path, and their attnkit commands that are not part of it: `attnkit matrix` only
# plans (which cells, their bake file); the rehearsal names its one cell itself.
RELEASE_WORKFLOWS = ("release.yml", "images.yml")
PLANNING = {("matrix",)}


def _subcommands() -> dict[tuple[str, ...], set[str]]:
    """Every attnkit command path ('images', 'promote') with its option names, from the real parser."""
    import argparse

    from attnkit.cli import build_parser

    out: dict[tuple[str, ...], set[str]] = {}

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[path] = {o for a in p._actions for o in a.option_strings if o.startswith("--")}
        for s in subs:
            for name, child in s.choices.items():
                walk(child, (*path, name))

    walk(build_parser(), ())
    return out


def invocations(script: str) -> list[tuple[tuple[str, ...], set[str]]]:
    """The attnkit commands a shell script runs: (command path, option names) for each."""
    import shlex

    known = _subcommands()
    found = []
    for line in script.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        try:
            toks = list(lex)
        except ValueError:  # an unbalanced quote: not a command line of ours
            continue
        for i, tok in enumerate(toks):
            if tok.rsplit("/", 1)[-1] != "attnkit":
                continue
            rest = toks[i + 1:]
            end = next((j for j, t in enumerate(rest) if t in ("|", "||", "&&", ";", ")", "&")), len(rest))
            rest = rest[:end]
            path: tuple[str, ...] = ()
            while rest and any(k[:len(path) + 1] == (*path, rest[0]) for k in known):
                path, rest = (*path, rest[0]), rest[1:]
            found.append((path, {t.split("=", 1)[0] for t in rest if t.startswith("--")}))
    return found


def workflow_commands(doc: dict[str, Any]) -> dict[str, list[tuple[tuple[str, ...], set[str]]]]:
    """job -> the attnkit commands its `run` steps name."""
    out: dict[str, list[tuple[tuple[str, ...], set[str]]]] = {}
    for job, spec in (doc.get("jobs") or {}).items():
        for st in spec.get("steps") or []:
            if isinstance(st.get("run"), str):
                out.setdefault(job, []).extend(invocations(st["run"]))
    return out


def drift(docs: dict[str, dict[str, Any]]) -> list[str]:
    """What differs between the release workflows (file name -> parsed YAML) and STEPS, one line each: a release
    command of a workflow no step names, a step whose job lacks its command, or options that differ."""
    problems = []
    shared = [s for s in STEPS if s.workflow]
    seen: set[tuple[str, str, tuple[str, ...]]] = set()
    for wf in RELEASE_WORKFLOWS:
        for job, cmds in workflow_commands(docs.get(wf, {})).items():
            for path, opts in cmds:
                if path in PLANNING:
                    continue
                mine = [s for s in shared if (s.workflow, s.job, s.command) == (wf, job, path)]
                if not mine:
                    problems.append(f"{wf} job {job} runs `attnkit {' '.join(path)}`, which no rehearsal step names")
                    continue
                seen.add((wf, job, path))
                for s in mine:
                    want = s.options - set(s.local_only)
                    if opts != want:
                        problems.append(f"{wf} job {job}: `attnkit {' '.join(path)}` has options {sorted(opts)}, "
                                        f"step {s.name} has {sorted(want)} (+ local only {sorted(s.local_only)})")
    for s in shared:
        if (s.workflow, s.job, s.command) not in seen:
            problems.append(f"step {s.name}: {s.workflow} job {s.job} does not run `attnkit {' '.join(s.command)}`")
    return problems
