#!/usr/bin/env bash
# Bytes on disk per event: reproduces the "Bytes on disk per event" figures in docs/benchmarks.md.
#
#   bench/disk.sh                      # 1,000 events of 1 KiB, 20 of 1 MiB
#   SMALL=200 LARGE=5 bench/disk.sh
#
# The release binary on the replay model (every event runs a turn, which the transcript records)
# and the `log` delivery. Per payload size, on a fresh state directory: post the events, wait
# until every one has ended, stop the daemon, checkpoint the WAL, and divide the pages in use
# (page_count - freelist_count) by the number of events. The empty database's pages are
# subtracted, so the figure is what each event adds: payload, stored headers, turn, transcript
# steps and delivery.
set -euo pipefail
cd "$(dirname "$0")/.."
SMALL=${SMALL:-1000}
LARGE=${LARGE:-20}
PORT=${PORT:-18797}
for tool in sqlite3 curl; do
    command -v "$tool" >/dev/null || { apt-get update -qq && apt-get install -y -qq sqlite3 curl >/dev/null; break; }
done
# BIN=path measures another build (another commit's binary) with the same script.
if [ -z "${BIN:-}" ]; then
    cargo build --release --locked -q
    BIN=./target/release/agentgate
fi
work=$(mktemp -d /var/tmp/agentgate-disk.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT

pages_in_use() {
    sqlite3 "$work/state/agentgate.db" "PRAGMA wal_checkpoint(TRUNCATE);" >/dev/null
    sqlite3 -separator " " "$work/state/agentgate.db" \
        "SELECT (SELECT page_count FROM pragma_page_count) - (SELECT freelist_count FROM pragma_freelist_count), (SELECT page_size FROM pragma_page_size);"
}

run() {
    local label=$1 events=$2 pad=$3
    rm -rf "$work/state"
    cat >"$work/agentgate.toml" <<TOML
state_dir = "$work/state"
[server]
listen = "127.0.0.1:$PORT"
control_socket = "$work/control.sock"
max_body = "2MiB"
[routes.disk]
path = "/hooks/disk"
verify = { scheme = "none" }
deliver = { kind = "log" }
TOML
    python3 - "$work/body.json" "$pad" <<'PY'
import json, sys
# A payload of about the given size, shaped like a webhook: nested objects, short strings,
# numbers and URLs (what makes a re-rendered, re-escaped copy larger than the original).
size = int(sys.argv[2])
body = {"action": "opened", "repository": {"full_name": "acme/web", "id": 1296269}, "items": []}
n = 0
while len(json.dumps(body)) < size:
    body["items"].append({"id": n, "name": f"item-{n}", "state": "open", "labels": ["bug", "triage"],
                          "url": f"https://api.example.com/repos/acme/web/issues/{n}"})
    n += 1
open(sys.argv[1], "w").write(json.dumps(body))
PY
    "$BIN" serve --config "$work/agentgate.toml" 2>"$work/agentgate.log" &
    local pid=$!
    until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.05; done
    read -r empty_pages page_size < <(pages_in_use)
    for _ in $(seq 1 "$events"); do
        curl -fs -o /dev/null -H 'content-type: application/json' --data-binary "@$work/body.json" \
            "http://127.0.0.1:$PORT/hooks/disk"
    done
    until [ "$(sqlite3 "$work/state/agentgate.db" "SELECT count(*) FROM deliveries WHERE status = 'delivered'")" -ge "$events" ]; do
        sleep 0.2
    done
    kill -TERM "$pid"
    wait "$pid" || true
    read -r pages _ < <(pages_in_use)
    local payload_bytes
    payload_bytes=$(stat -c %s "$work/body.json")
    python3 -c "
events, payload, used, page = $events, $payload_bytes, $pages - $empty_pages, $page_size
print(f'$label\tpayload {payload} B\t{used * page / events:,.0f} B per event\t{used * page / events / payload:.2f}x payload')"
}

[ "$SMALL" -eq 0 ] || run 1KiB "$SMALL" 1024
[ "$LARGE" -eq 0 ] || run 1MiB "$LARGE" 1048576
