#!/usr/bin/env bash
# Type-checks tools/grafana/ramjet.json against Grafana's own dashboard schema: the TypeScript
# types Grafana publishes as @grafana/schema (its `Dashboard`, generated from the schema Grafana
# validates imports with), compiled with tsc in strict mode. Not part of the test command (it
# installs from the npm registry); run it after editing the dashboard.
#   bash tools/grafana/check.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm init -y >/dev/null
npm install -s --no-audit --no-fund @grafana/schema@13.2.3 typescript@5 >/dev/null
cp "$here/ramjet.json" dash.json
cat > check.ts <<'TS'
import type { Dashboard } from "@grafana/schema/dist/types/raw/dashboard/x/types.gen";
import d from "./dash.json";
// The export-only inputs aside, the file must be a Dashboard as Grafana's schema defines it.
const { __inputs, __requires, ...rest } = d;
const dash: Dashboard = rest;
export default dash;
TS
cat > tsconfig.json <<'JSON'
{ "compilerOptions": { "strict": true, "resolveJsonModule": true, "esModuleInterop": true,
  "module": "commonjs", "moduleResolution": "node", "noEmit": true, "skipLibCheck": true,
  "target": "es2020" }, "files": ["check.ts"] }
JSON
npx tsc -p .
echo "tools/grafana/ramjet.json: a Dashboard by @grafana/schema 13.2.3"
