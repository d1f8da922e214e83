# Sourced by bench/accept.sh and bench/instructions.sh: the accept path on its own. A
# `verify = none` route on loopback, a command model that never answers and
# `max_concurrent_turns = 1`, so that accepted events stay queued.
#
# accept_setup WORK PORT writes into WORK: body.json (1 KiB of JSON), post.lua (wrk's script
# posting it), never-answers (the model), agentgate.toml (with EXTRA_CONFIG appended) and backlog.sql (BACKLOG queued events,
# each in a session of its own, as the load makes them, for the daemon's stopped database).
accept_setup() {
    local work=$1 port=$2
    python3 -c '
import json
print(json.dumps({"action": "opened", "issue": {"number": 7}, "pad": "x" * 950}), end="")' \
        > "$work/body.json"
    python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
body = open(f"{work}/body.json").read()
open(f"{work}/post.lua", "w").write(
    'wrk.method = "POST"\nwrk.body = %s\nwrk.headers["Content-Type"] = "application/json"\n'
    % json.dumps(body))
PY
    printf '#!/bin/sh\nexec sleep 100000\n' > "$work/never-answers"
    chmod +x "$work/never-answers"
    cat > "$work/agentgate.toml" <<TOML
state_dir = "$work/state"
[server]
listen = "127.0.0.1:$port"
control_socket = "$work/control.sock"
# The accept path is measured, not the backlog limit.
[runtime]
max_queued_events = 100000000
max_concurrent_turns = 1
drain_timeout = "1s"
[model]
backend = "command"
command = ["$work/never-answers"]
request_timeout = "3600s"
[routes.bench]
path = "/hooks/bench"
verify = { scheme = "none" }
${EXTRA_CONFIG:-}
TOML
    cat > "$work/backlog.sql" <<SQL
BEGIN;
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ${BACKLOG:-100000})
INSERT INTO events (id, route, session_key, event_type, headers, payload, received_at, status,
                    updated_at)
SELECT 'backlog-' || i, 'bench', 'bench:backlog-' || i, '', '{"content-type":"application/json"}',
       CAST(readfile('$work/body.json') AS BLOB), CAST(unixepoch() AS INTEGER) * 1000, 'queued',
       CAST(unixepoch() AS INTEGER) * 1000
FROM n;
INSERT INTO sessions (key, route, state, created_at, updated_at)
SELECT session_key, route, 'idle', received_at, received_at FROM events WHERE id LIKE 'backlog-%';
COMMIT;
SQL
}
