"""After `attnkit wheels build --shard`: print the shard's summary, and copy its report and the objects of its
own units (by key) into DEST, the artifact the link job gathers. Python, not jq: the manylinux container that
compiles has no jq. Usage: python shard-export.py REPORT STORE DEST"""

import json
import shutil
import sys
from pathlib import Path

report, store, dest = (Path(a) for a in sys.argv[1:4])
shard = json.loads(report.read_text(encoding="utf-8"))["shard"]
print(json.dumps({k: shard.get(k) for k in ("shard", "compiled", "restored", "unit_seconds")}))
missing = [src for src, key in shard["keys"].items() if not (store / f"{key}.o").is_file()]
if missing:
    sys.exit(f"shard-export: {len(missing)} of this shard's objects are not in {store}: {', '.join(missing[:3])}")
dest.mkdir(parents=True, exist_ok=True)
shutil.copy2(report, dest / report.name)
for key in shard["keys"].values():
    shutil.copy2(store / f"{key}.o", dest / f"{key}.o")
print(f"{len(shard['keys'])} objects -> {dest}")
