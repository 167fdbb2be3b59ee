#!/usr/bin/env bash
# Regenerate dashboard.schema.json from Grafana's own TypeScript types.
# Needs node + npm and registry access; works in a throw-away directory, never in the repo.
set -euo pipefail
GRAFANA_SCHEMA_VERSION="${GRAFANA_SCHEMA_VERSION:-13.2.3}"
GENERATOR_VERSION="${GENERATOR_VERSION:-2.9.0}"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm init -y >/dev/null
npm install --no-audit --no-fund --silent \
  "@grafana/schema@${GRAFANA_SCHEMA_VERSION}" "ts-json-schema-generator@${GENERATOR_VERSION}"
cp node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts dash_types.d.ts
# --additional-properties: Grafana tolerates (and grafanalib emits) keys the types do not list;
# the schema checks the shape and types of the keys it knows.
npx ts-json-schema-generator --path dash_types.d.ts --type Dashboard --no-type-check \
  --additional-properties -o "$here/dashboard.schema.json"
echo "wrote $here/dashboard.schema.json from @grafana/schema@${GRAFANA_SCHEMA_VERSION}"
