#!/usr/bin/env bash
# Builds the release binary with the code it runs laid out first (debian/rules uses it):
#
#   packaging/build-ordered.sh OUT          # -> OUT, the binary the package installs
#
# Why: the kernel maps a file's code into a process in 64 KiB windows around each page it
# executes (fault-around), so resident memory follows how scattered the executed functions are,
# not how many there are. In a plain build the few hundred KiB that a start, an idle daemon and one
# event run are spread over most of the 25 MB of code, and the idle daemon maps about 13 MiB of
# it. Here the linker (rust-lld, --symbol-ordering-file) puts those functions first, one after
# the other (docs/benchmarks.md, "Idle RSS").
#
# How: (1) build; (2) run that binary under valgrind's callgrind on a copy of the embedded
# defaults (a loopback port of its own, the bundled replay cassette), send it one event, let it
# finish, stop it, and list every function it executed, in the order it first ran them; (3) build
# again with that list. Both builds pass the linker the same arguments (the list's path), so
# their code and its symbol names are the same and only the layout differs: ThinLTO's local
# names (`.llvm.<hash>`) depend on the compiler's arguments, and a list taken from a build made
# with other arguments misses them. Needs valgrind and nm (Build-Depends).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: packaging/build-ordered.sh OUT}
CARGO=${CARGO:-cargo}
order=$PWD/target/code-order.txt
stamp=$PWD/target/code-order.stamp
mkdir -p target "$(dirname "$out")"
build() {
    "$CARGO" rustc --release --locked --bin agentgate -- \
        -C link-arg=-Wl,--symbol-ordering-file="$order" -C link-arg=-Wl,--no-warn-symbol-ordering
}

# Laid out before, and no source changed since (cargo then leaves the binary as it is): that
# binary is the one, and profiling it again would give the same list. (tests/run builds the
# package ahead of the package test, which builds it again.)
if [ -s "$order" ] && [ -f "$stamp" ]; then
    build
    if sha256sum --status -c "$stamp"; then
        cp target/release/agentgate "$out"
        echo "build-ordered: unchanged since it was laid out"
        exit 0
    fi
fi

: >"$order"
build
work=$(mktemp -d)
trap 'pkill -KILL -f "$work/agentgate serve" 2>/dev/null || true; rm -rf "$work"' EXIT
# A copy: another cargo build may replace target/release/agentgate meanwhile.
cp target/release/agentgate "$work/agentgate"
bin=$work/agentgate

sed -e "s|^state_dir = .*|state_dir = \"$work/state\"|" \
    -e 's|^listen = .*|listen = "127.0.0.1:0"|' \
    -e "s|^\[server\]|[server]\ncontrol_socket = \"$work/control.sock\"|" \
    examples/quickstart.toml >"$work/agentgate.toml"
cd "$work"
valgrind --tool=callgrind --demangle=no --callgrind-out-file="$work/callgrind.out" \
    "$bin" serve --config "$work/agentgate.toml" >"$work/serve.log" 2>&1 &
daemon=$!
waited=0
until grep -q "is accepting webhooks" "$work/serve.log"; do
    kill -0 "$daemon" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
    [ $((waited += 1)) -lt 1200 ] || { echo "build-ordered: the daemon did not start" >&2; exit 1; }
    sleep 0.1
done
"$bin" send demo --config "$work/agentgate.toml" --data '{"alert": "disk full on db-1"}' >/dev/null
waited=0
until "$bin" status --config "$work/agentgate.toml" 2>/dev/null | grep -Eq "events: +1 total \((completed|failed) 1\)"; do
    [ $((waited += 1)) -lt 1200 ] || { echo "build-ordered: the event did not end" >&2; exit 1; }
    sleep 0.1
done
kill -TERM "$daemon"
wait "$daemon" || true

# callgrind names a function at its first mention, `fn=(N) name` or `cfn=(N) name`, and by its
# number after; the `fn=` lines are the functions that ran, in the order they first ran.
nm --defined-only "$bin" | awk '$2 ~ /^[tT]$/ { print $3 }' | sort -u >"$work/symbols"
awk '
    match($0, /^c?fn=\([0-9]+\)/) {
        id = substr($0, RSTART, RLENGTH); sub(/^c?fn=/, "", id)
        if (length($0) > RLENGTH + 1) name[id] = substr($0, RLENGTH + 2)
        if ($0 ~ /^fn=/ && !(id in seen)) { seen[id] = 1; ran[++count] = id }
    }
    END { for (i = 1; i <= count; i++) if (ran[i] in name) print name[ran[i]] }
' "$work/callgrind.out" | awk 'NR == FNR { known[$0] = 1; next } ($0 in known) && !($0 in done) { done[$0] = 1; print }' \
    "$work/symbols" - >"$order.new"
functions=$(wc -l <"$order.new")
[ "$functions" -gt 1000 ] || { echo "build-ordered: only $functions functions ran" >&2; exit 1; }
mv "$order.new" "$order"
echo "build-ordered: $functions functions laid out first"

cd - >/dev/null
# The same arguments again; main.rs touched so that the binary is linked anew with the list.
touch src/main.rs
build
sha256sum target/release/agentgate >"$stamp"
cp target/release/agentgate "$out"
