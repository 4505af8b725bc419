"""Every module of attnkit imports on its own, in a fresh process (an import cycle fails here: a module that
needs another to be imported first), and `import attnkit` loads neither torch nor any attention library."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import attnkit


def _modules() -> list[str]:
    root = Path(attnkit.__file__).parent
    return sorted(m.name for m in pkgutil.walk_packages([str(root)], prefix="attnkit.")
                  if not m.name.endswith("__main__"))


def test_every_module_imports_alone_in_a_fresh_process():
    mods = _modules()
    assert len(mods) > 60 and "attnkit.runtime.dispatch" in mods and "attnkit.bench.timer" in mods
    # an interpreter per module would take minutes: one process imports each module after dropping every attnkit
    # module from sys.modules, so each import starts from none of attnkit loaded
    code = (
        "import importlib, sys\n"
        f"mods = {mods!r}\n"
        "bad = []\n"
        "for m in mods:\n"
        "    for k in [k for k in sys.modules if k == 'attnkit' or k.startswith('attnkit.')]:\n"
        "        del sys.modules[k]\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as exc:\n"
        "        bad.append(f'{m}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(bad) or 'ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.stdout.strip() == "ok", r.stdout + r.stderr[-2000:]


def test_import_attnkit_loads_no_torch_and_no_attention_library():
    code = ("import sys, attnkit\n"
            "heavy = [m for m in ('torch', 'flash_attn', 'xformers', 'cudnn', 'transformers') if m in sys.modules]\n"
            "print(heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
