#!/usr/bin/env bash
# Retention soak: reproduces the "Retention soak" figures and docs/retention-soak.svg.
#
#   bench/retention.sh                         # one hour at 500 events/s, retention = "5m"
#   SOAK_MINUTES=10 RATE=500 bench/retention.sh
#   BIN=/path/to/other/agentgate bench/retention.sh   # the same soak with another build
#
# The release binary on the replay model (every event runs a turn, recorded in the transcript,
# and ends with a `log` delivery), one route verified with hmac-sha256, 1 KiB signed bodies.
# The load is open loop (benches/loadgen.rs) in one-minute windows; per window it records the
# accepts/s and the p50/p99 accept latency. Every 15 s a sampler records the database size
# (agentgate.db and its WAL), the events stored and the daemon's RSS. At the end the samples
# are drawn as an SVG (database size and p99 over time).
set -euo pipefail
cd "$(dirname "$0")/.."
SOAK_MINUTES=${SOAK_MINUTES:-60}
RATE=${RATE:-500}
RETENTION=${RETENTION:-5m}
PORT=${PORT:-18798}
OUT=${OUT:-docs/retention-soak}
for tool in sqlite3 curl; do
    command -v "$tool" >/dev/null || { apt-get update -qq && apt-get install -y -qq sqlite3 curl >/dev/null; break; }
done
if [ -z "${BIN:-}" ]; then
    cargo build --release --locked -q
    BIN=./target/release/agentgate
fi
work=$(mktemp -d /var/tmp/agentgate-retention.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
# Both binaries are copied once, so that a build in this checkout during the hour changes
# neither (and no window waits for cargo).
cp "$BIN" "$work/agentgate"
loadgen=$(cargo bench --locked -q --bench loadgen --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')
cp "$loadgen" "$work/loadgen"

python3 - "$work" <<'PY'
import hmac, hashlib, json, sys
work = sys.argv[1]
body = json.dumps({"action": "opened", "issue": {"number": 7}, "pad": "x" * 950})
open(f"{work}/body.json", "w").write(body)
signature = "sha256=" + hmac.new(b"soak-secret", body.encode(), hashlib.sha256).hexdigest()
open(f"{work}/signature", "w").write(signature)
PY
cat >"$work/agentgate.toml" <<TOML
state_dir = "$work/state"
[server]
listen = "127.0.0.1:$PORT"
control_socket = "$work/control.sock"
[store]
retention = "$RETENTION"
[routes.soak]
path = "/hooks/soak"
verify = { scheme = "hmac-sha256", secret = "soak-secret" }
deliver = { kind = "log" }
TOML
AGENTGATE_LOG=warn "$work/agentgate" serve --config "$work/agentgate.toml" 2>"$work/agentgate.log" &
pid=$!
until curl -fs "http://127.0.0.1:$PORT/healthz" >/dev/null; do sleep 0.05; done
started=$(date +%s)

sampler() {
    printf 'elapsed_s\tdb_bytes\twal_bytes\tevents\trss_kib\n'
    while kill -0 "$pid" 2>/dev/null; do
        local db wal events rss
        db=$(stat -c %s "$work/state/agentgate.db" 2>/dev/null || echo 0)
        wal=$(stat -c %s "$work/state/agentgate.db-wal" 2>/dev/null || echo 0)
        events=$(sqlite3 "file:$work/state/agentgate.db?mode=ro" "PRAGMA busy_timeout = 5000; SELECT count(*) FROM events" 2>/dev/null | tail -1)
        rss=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
        printf '%s\t%s\t%s\t%s\t%s\n' "$(($(date +%s) - started))" "$db" "$wal" "${events:-0}" "$rss"
        sleep 15
    done
}
sampler >"$work/samples.tsv" &

printf 'minute\taccepts_per_s\tp50_ms\tp99_ms\tnon_202\n' >"$work/windows.tsv"
for minute in $(seq 1 "$SOAK_MINUTES"); do
    result=$("$work/loadgen" --addr "127.0.0.1:$PORT" --path /hooks/soak \
        --body "$work/body.json" --header "x-signature: $(cat "$work/signature")" \
        --rate "$RATE" --connections 32 --seconds 60)
    python3 - "$minute" "$result" >>"$work/windows.tsv" <<'PY'
import json, sys
d = json.loads(sys.argv[2])
other = sum(c for s, c in d["statuses"].items() if s != "202") + d["errors"]
print(f'{sys.argv[1]}\t{d["per_second"]}\t{d["p50_ms"]}\t{d["p99_ms"]}\t{other}')
PY
    tail -1 "$work/windows.tsv" >&2
done
kill -TERM "$pid"
wait "$pid" || true
sleep 1
cp "$work/samples.tsv" "$OUT-samples.tsv"
cp "$work/windows.tsv" "$OUT-windows.tsv"

python3 - "$OUT" "$RATE" "$RETENTION" <<'PY'
import csv, sys
out, rate, retention = sys.argv[1], sys.argv[2], sys.argv[3]
samples = list(csv.DictReader(open(f"{out}-samples.tsv"), delimiter="\t"))
windows = list(csv.DictReader(open(f"{out}-windows.tsv"), delimiter="\t"))
t = [int(s["elapsed_s"]) / 60 for s in samples]
size = [(int(s["db_bytes"]) + int(s["wal_bytes"])) / 2**20 for s in samples]
p99 = [(int(w["minute"]) - 0.5, float(w["p99_ms"])) for w in windows]
W, H, L, R, T, B = 760, 360, 70, 70, 40, 50
tmax = max(t + [m for m, _ in p99] + [1])
smax = max(size + [1]) * 1.1
pmax = max([v for _, v in p99] + [5]) * 1.2
x = lambda v: L + (W - L - R) * v / tmax
ys = lambda v: H - B - (H - T - B) * v / smax
yp = lambda v: H - B - (H - T - B) * v / pmax
parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W/2}" y="20" text-anchor="middle" font-size="14">agentgate retention soak: {rate} events/s, retention = "{retention}"</text>',
         f'<line x1="{L}" y1="{H-B}" x2="{W-R}" y2="{H-B}" stroke="black"/>',
         f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H-B}" stroke="#1f77b4"/>',
         f'<line x1="{W-R}" y1="{T}" x2="{W-R}" y2="{H-B}" stroke="#d62728"/>']
for i in range(0, 6):
    v = tmax * i / 5
    parts.append(f'<text x="{x(v)}" y="{H-B+16}" text-anchor="middle">{v:.0f}</text>')
    s = smax * i / 5
    parts.append(f'<text x="{L-6}" y="{ys(s)+4}" text-anchor="end" fill="#1f77b4">{s:.0f}</text>')
    p = pmax * i / 5
    parts.append(f'<text x="{W-R+6}" y="{yp(p)+4}" fill="#d62728">{p:.1f}</text>')
parts.append(f'<line x1="{L}" y1="{yp(5)}" x2="{W-R}" y2="{yp(5)}" stroke="#d62728" stroke-dasharray="4 4"/>')
parts.append(f'<text x="{W/2}" y="{H-12}" text-anchor="middle">minutes</text>')
parts.append(f'<text x="16" y="{H/2}" transform="rotate(-90 16 {H/2})" text-anchor="middle" fill="#1f77b4">database + WAL (MiB)</text>')
parts.append(f'<text x="{W-14}" y="{H/2}" transform="rotate(90 {W-14} {H/2})" text-anchor="middle" fill="#d62728">p99 accept latency per minute (ms; dashed: 5 ms)</text>')
parts.append('<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="' + " ".join(f"{x(a):.1f},{ys(b):.1f}" for a, b in zip(t, size)) + '"/>')
parts.append('<polyline fill="none" stroke="#d62728" stroke-width="1.5" points="' + " ".join(f"{x(a):.1f},{yp(b):.1f}" for a, b in p99) + '"/>')
parts.append("</svg>")
open(f"{out}.svg", "w").write("\n".join(parts))
rates = [float(w["accepts_per_s"]) for w in windows]
p99s = [float(w["p99_ms"]) for w in windows]
refused = sum(int(w["non_202"]) for w in windows)
half = len(size) // 2
print(f"windows {len(windows)}; accepts/s first {rates[0]:.0f} last {rates[-1]:.0f} min {min(rates):.0f}; "
      f"p99 max {max(p99s):.2f} ms median {sorted(p99s)[len(p99s)//2]:.2f} ms; non-202 {refused}; "
      f"db+wal MiB at 1/2 {size[half]:.0f}, max in 2nd half {max(size[half:]):.0f}, end {size[-1]:.0f}; "
      f"events stored at end {samples[-1]['events']}; rss KiB end {samples[-1]['rss_kib']}")
PY
