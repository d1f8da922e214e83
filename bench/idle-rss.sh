#!/usr/bin/env bash
# What the daemon's idle RSS is made of: reproduces "Idle RSS, taken apart" in docs/benchmarks.md.
#
#   bench/idle-rss.sh                        # this checkout's release build
#   BIN=/tmp/before/agentgate bench/idle-rss.sh
#
# The gateway on its embedded defaults (README's first command), in a fresh directory. Reported:
#   1. RSS one second after start, split into anonymous memory and each file mapped (the
#      executable's code, its read-only data, libc);
#   2. the page faults the start took in the executable's code (perf, one sample per fault): the
#      pages it actually touched, and the 64 KiB windows they fall in (the kernel maps a whole
#      window around each fault of a file already in the page cache, "fault-around");
#   3. the code's pages reclaimed from outside (process_madvise MADV_PAGEOUT), then RSS again
#      after IDLE_SECONDS at rest: what the daemon maps back while it idles.
# Needs: perf (linux-perf), python3 (installed with apt-get if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-$PWD/target/release/agentgate}
IDLE_SECONDS=${IDLE_SECONDS:-10}
[ -x "$BIN" ] || cargo build --release --locked -q
command -v perf >/dev/null || { apt-get update -qq && apt-get install -y -qq linux-perf >/dev/null; }

work=$(mktemp -d)
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
cd "$work"

# The start alone, under perf, for its page faults.
timeout -s INT 3 perf record -q -e minor-faults -c 1 -d -o perf.data "$BIN" serve >perf-serve.log 2>&1 || true
rm -rf agentgate-state

"$BIN" serve >serve.log 2>&1 &
pid=$!
until grep -q "is accepting webhooks" serve.log; do sleep 0.1; done
sleep 1

python3 - "$pid" "$BIN" "$IDLE_SECONDS" <<'PY'
import ctypes, os, subprocess, sys, time

pid, exe, idle = int(sys.argv[1]), os.path.realpath(sys.argv[2]), int(sys.argv[3])

def mappings():
    """(start, end, perms, path, rss KiB, anonymous KiB) of each mapping."""
    found, current = [], None
    for line in open(f"/proc/{pid}/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            current = [start, end, fields[1], fields[5] if len(fields) > 5 else "", 0, 0]
            found.append(current)
        elif fields[0] == "Rss:":
            current[4] = int(fields[1])
        elif fields[0] == "Anonymous:":
            current[5] = int(fields[1])
    return found

def report(title):
    maps = mappings()
    total = sum(m[4] for m in maps)
    anonymous = sum(m[5] for m in maps)
    print(f"{title}: RSS {total} KiB, anonymous {anonymous} KiB")
    by_file = {}
    for start, end, perms, path, rss, anon in maps:
        if path.startswith("/") and rss - anon > 0:
            name = f"{os.path.basename(path)} {perms}"
            by_file[name] = by_file.get(name, 0) + rss - anon
    for name, kib in sorted(by_file.items(), key=lambda item: -item[1])[:5]:
        print(f"  file-backed {kib:>6} KiB  {name}")

report("one second after start")

# The start's faults in the executable's code, from perf's record of a separate start.
mmaps = subprocess.run(["perf", "script", "-i", "perf.data", "--show-mmap-events"],
                       capture_output=True, text=True).stdout
code = None
for line in mmaps.splitlines():
    if "PERF_RECORD_MMAP" in line and line.rstrip().endswith(exe) and "r-xp" in line:
        span = line.split("[")[1].split("]")[0].split()[0]
        start, length = span.split("(")
        code = (int(start, 16), int(start, 16) + int(length.rstrip(")"), 16))
faults = subprocess.run(["perf", "script", "-i", "perf.data", "-F", "addr"],
                        capture_output=True, text=True).stdout.split()
if code:
    pages = {(int(a, 16) - code[0]) >> 12 for a in faults if code[0] <= int(a, 16) < code[1]}
    windows = {page >> 4 for page in pages}
    print(f"the start's faults in the code: {len(pages)} pages ({len(pages) * 4} KiB) "
          f"in {len(windows)} windows of 64 KiB ({len(windows) * 64} KiB)")

# Reclaim the code's pages, then let the daemon idle.
libc = ctypes.CDLL(None, use_errno=True)
pidfd = libc.syscall(434, pid, 0)  # pidfd_open
class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
for start, end, perms, path, _, _ in mappings():
    if path == exe and perms == "r-xp":
        span = Iovec(start, end - start)
        libc.syscall(440, pidfd, ctypes.byref(span), 1, 21, 0)  # process_madvise, MADV_PAGEOUT
report("the code reclaimed")
time.sleep(idle)
report(f"then {idle} s at rest")
PY
