# A tool that tries every escape a prompt-injected model could ask of it, and the legitimate
# work a tool does, and prints what happened as JSON ("done" or "refused: <why>"); with a last
# argument, it also writes that JSON to the file it names.
# Arguments: database credential secret control-socket outside-file work-dir port [report]
import json, socket, sys

db, credential, secret, control, outside, work, port = sys.argv[1:8]
report = sys.argv[8] if len(sys.argv) > 8 else None


def read(path):
    with open(path, "rb") as f:
        if not f.read():
            raise OSError("nothing to read")


def write(path):
    with open(path, "w") as f:
        f.write("written")


def unix(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(path)
    s.close()


def tcp(port):
    socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()


def attempt(action):
    try:
        action()
        return "done"
    except Exception as err:
        return "refused: %s: %s" % (type(err).__name__, err)


name = (report or "probe").split("/")[-1]
results = {
    "read_database": attempt(lambda: read(db)),
    "read_credential": attempt(lambda: read(credential)),
    "read_secret_file": attempt(lambda: read(secret)),
    "connect_control_socket": attempt(lambda: unix(control)),
    "write_outside_writable": attempt(lambda: write(outside)),
    "reach_loopback": attempt(lambda: tcp(port)),
    "write_in_writable": attempt(lambda: write(work + "/legit.txt")),
    "read_system_file": attempt(lambda: read("/etc/os-release")),
    "write_private_tmp": attempt(lambda: write("/tmp/agentgate-probe-" + name)),
}
print(json.dumps(results))
if report:
    with open(report, "w") as f:
        json.dump(results, f)
