# A tool that tries every way out a prompt-injected model could ask of it, and the legitimate
# work a tool does, and prints what happened as JSON: each attempt "done" or "refused: <why>".
# Usage: escape-probe.py PLAN.json [REPORT]; with REPORT, it also writes the JSON there.
#
# The plan names what to try (every key optional):
#   read        {name: path}        read a file (the state, a credential, a secret, the config)
#   write       {name: path}        write a file
#   stream      {name: path}        connect to a Unix stream socket (D-Bus, journald's stdout)
#   datagram    {name: path}        send to a Unix datagram socket (journald, /dev/log)
#   abstract    {name: socket name} connect to an abstract Unix socket
#   tcp         {name: port}        connect to 127.0.0.1:port, or to "HOST:PORT"
#   bind        {name: port}        listen on 0.0.0.0:port
#   control     path                the control socket: approve every pending approval
#   tool_socket {name: path}        a tool-unit socket: run a shell with no sandbox, and with one
#                                   that hides nothing and has the network; "done" if it ran
#   postgres    {name: [path, user]} PostgreSQL's socket: log in as user (peer authentication)
#   proc_roots  [path]              read path through every /proc/PID/root this process can see
#   kernel      [name]              reach more of the kernel: "user_namespace" (become root of a
#                                   new one), "io_uring" (set a ring up), "keyring" (add a key)
#   legit       {name: [kind, arg]} what must work: ["write", path] or ["read", path]
# The report also gives the uid the probe ran as.
import array, ctypes, json, os, socket, struct, sys

plan = json.load(open(sys.argv[1]))
report = sys.argv[2] if len(sys.argv) > 2 else None
MARKER = "agentgate-escaped"


def read(path):
    with open(path, "rb") as f:
        if not f.read():
            raise OSError("nothing to read")


def write(path):
    with open(path, "w") as f:
        f.write("written")


def unix(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect(path)
    return s


def stream(path):
    unix(path).close()


def datagram(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(b"<3>agentgate escape probe\n", path)
    s.close()


def abstract(name):
    unix("\0" + name).close()


def tcp(target):
    host, _, port = str(target).rpartition(":")
    socket.create_connection((host or "127.0.0.1", int(port)), timeout=3).close()


def listen(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("0.0.0.0", int(port)))
    s.listen(1)
    s.close()


def http(path, method, target, body=b""):
    s = unix(path)
    head = "%s %s HTTP/1.1\r\nHost: control\r\nContent-Type: application/json\r\n" % (method, target)
    head += "Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    s.sendall(head.encode() + body)
    answer = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
    s.close()
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[-1]


def control(path):
    status, body = http(path, "GET", "/v1/approvals")
    if status != 200:
        raise OSError("GET /v1/approvals: %d" % status)
    pending = json.loads(body).get("approvals", [])
    if not pending:
        raise OSError("connected, but nothing to approve")
    for approval in pending:
        status, body = http(path, "POST", "/v1/approvals/%s/approve" % approval["id"], b'{"note":"probe"}')
        if status != 200:
            raise OSError("approve: %d %s" % (status, body[:200]))


def tool_socket(path, confinement):
    """One request as the daemon sends it (a big-endian length, then JSON); "done" if the shell
    ran and printed the marker."""
    program = "/bin/sh"
    script = "echo %s; id; ls /var/lib/agentgate /run/agentgate 2>&1 | head -n 5" % MARKER
    call = {"program": program, "args": ["-c", script], "env": [], "cwd": None, "confinement": confinement}
    # As the request is framed now, and as it was before requests had kinds: a way out through
    # either is a way out.
    reasons = []
    for body in (json.dumps({"Run": call}).encode(), json.dumps(call).encode()):
        try:
            return tool_request(path, body)
        except OSError as err:
            reasons.append(str(err))
    raise OSError("; ".join(reasons))


def tool_request(path, body):
    """Sends the request as the daemon does; a tool unit that starts the call hands back the
    call's stdin, stdout and stderr pipes first (SCM_RIGHTS), then answers."""
    s = unix(path)
    s.settimeout(10)
    s.sendall(struct.pack(">I", len(body)) + body)
    first, ancillary, _, _ = s.recvmsg(1, socket.CMSG_SPACE(3 * 4))
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    answer = b"" if fds else first
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
    s.close()
    output = ""
    if len(fds) == 3:
        os.close(fds[0])
        os.set_blocking(fds[1], False)
        try:
            output = os.read(fds[1], 65536).decode(errors="replace")
        except BlockingIOError:
            pass
    for fd in fds[1:]:
        os.close(fd)
    if MARKER not in output:
        raise OSError("did not run: %s" % answer.decode(errors="replace").strip()[:300])


# Nothing hidden, everything writable, the network ("bwrap" for requests that named their own).
LAX = {"bwrap": "/usr/bin/bwrap", "network": True, "writable": ["/"], "hidden_dirs": [], "hidden_files": []}


def postgres(path, user):
    s = unix(path)
    params = b"user\0" + user.encode() + b"\0database\0postgres\0\0"
    s.sendall(struct.pack(">II", 8 + len(params), 196608) + params)
    kind = s.recv(1)
    if kind != b"R":
        raise OSError("the server answered %r" % kind)
    (length, code) = struct.unpack(">II", s.recv(8))
    s.close()
    if code != 0:
        raise OSError("authentication %d asked for" % code)


def proc_roots(path):
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != str(os.getpid()):
            try:
                read("/proc/%s/root%s" % (pid, path))
                return
            except OSError:
                pass
    raise OSError("no /proc/PID/root shows it")


LIBC = ctypes.CDLL(None, use_errno=True)
# x86_64 system call numbers.
KERNEL = {
    "user_namespace": lambda: LIBC.unshare(0x10000000),  # CLONE_NEWUSER
    "io_uring": lambda: LIBC.syscall(425, 4, ctypes.create_string_buffer(120)),  # io_uring_setup
    "keyring": lambda: LIBC.syscall(248, b"user", b"probe", b"x", 1, -4),  # add_key, to the user keyring
}


def kernel(name):
    if KERNEL[name]() < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def attempt(action):
    try:
        action()
        return "done"
    except Exception as err:
        return "refused: %s: %s" % (type(err).__name__, err)


# The plan's keys whose value is {name: argument}, each tried with one function.
SIMPLE = {
    "read": read,
    "write": write,
    "stream": stream,
    "datagram": datagram,
    "abstract": abstract,
    "tcp": tcp,
    "bind": listen,
}

results = {}
for kind, action in SIMPLE.items():
    for name, argument in plan.get(kind, {}).items():
        results[name] = attempt(lambda: action(argument))
if "control" in plan:
    results["approve_through_control_socket"] = attempt(lambda: control(plan["control"]))
for name, path in plan.get("tool_socket", {}).items():
    results[name + "_null_confinement"] = attempt(lambda: tool_socket(path, None))
    results[name + "_lax_confinement"] = attempt(lambda: tool_socket(path, LAX))
for name, (path, user) in plan.get("postgres", {}).items():
    results[name] = attempt(lambda: postgres(path, user))
for path in plan.get("proc_roots", []):
    results["read_through_proc_root " + path] = attempt(lambda: proc_roots(path))
for name in plan.get("kernel", []):
    results["kernel_" + name] = attempt(lambda: kernel(name))
legit = {}
for name, (kind, arg) in plan.get("legit", {}).items():
    legit[name] = attempt(lambda: {"write": write, "read": read}[kind](arg))
out = {"escapes": results, "legit": legit, "uid": os.getuid()}
print(json.dumps(out))
if report:
    with open(report, "w") as f:
        json.dump(out, f)
