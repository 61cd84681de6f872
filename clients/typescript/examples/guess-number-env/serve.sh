#!/usr/bin/env bash
# Starts the TypeScript guess_number environment server: compiles it first when a source changed
# since the last build (into dist/ beside this script), then runs it in this process.
#
#   clients/typescript/examples/guess-number-env/serve.sh --port 50054 [server.ts's flags]
#
# Needs node (20 or later) and the package's npm dependencies (`npm ci` in clients/typescript).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
package="$(cd "$here/../.." && pwd)"
entry="$here/dist/examples/guess-number-env/server.js"
if [ ! -x "$package/node_modules/.bin/tsc" ]; then
  echo "no TypeScript compiler: run 'npm ci' in $package first" >&2
  exit 2
fi
if [ ! -f "$entry" ] || [ -n "$(find "$here" "$package/src/gen" "$package/tsconfig.json" -path "$here/dist" -prune \
    -o -newer "$entry" \( -name '*.ts' -o -name 'tsconfig.json' \) -print -quit)" ]; then
  "$package/node_modules/.bin/tsc" -p "$here"
fi
exec node "$entry" "$@"
