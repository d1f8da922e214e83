# A tool-unit socket in front of a real one (tests/sandbox.rs): each connection's request is
# passed to the real socket and everything after it relayed both ways, descriptors included,
# except a request that names STALL: that connection is held, unanswered, as a tool unit that
# never starts its call would hold it.
# Usage: stalling-units.py LISTEN REAL STALL
import os, socket, struct, sys, threading

listen_path, real_path, stall = sys.argv[1], sys.argv[2], sys.argv[3].encode()
held = []


def exact(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def pump(source, sink):
    try:
        while True:
            data, fds, _, _ = socket.recv_fds(source, 65536, 3)
            if not data:
                break
            if fds:
                socket.send_fds(sink, [data], fds)
                for fd in fds:  # the receiver's now: a copy held here would keep a pipe open
                    os.close(fd)
            else:
                sink.sendall(data)
    except OSError:
        pass
    for conn in (source, sink):
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def serve(conn):
    try:
        head = exact(conn, 4)
        body = exact(conn, struct.unpack(">I", head)[0])
    except (EOFError, OSError):
        return
    if stall in body:
        held.append(conn)
        return
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    upstream.connect(real_path)
    upstream.sendall(head + body)
    threading.Thread(target=pump, args=(conn, upstream), daemon=True).start()
    pump(upstream, conn)


server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(listen_path)
server.listen(64)
while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
