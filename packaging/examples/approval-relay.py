#!/usr/bin/env python3
"""Relays agentgate's deliveries to a chat's incoming webhook (Slack, Mattermost, Rocket.Chat,
and Discord with /slack appended all take {"text": ...}).

An approval request becomes a message with what the agent asks for and its approve and deny
links (agentgate's [server] public_url must be set for them); a result becomes a short line.
Every delivery's Standard Webhooks signature is checked first, so nobody else can post to the
chat through it. Python's standard library only.

    RELAY_LISTEN=127.0.0.1:9100 RELAY_SECRET_FILE=/etc/agentgate/deliver.secret \
    CHAT_URL_FILE=/etc/agentgate/chat-webhook-url python3 approval-relay.py
"""

import base64
import hashlib
import hmac
import json
import os
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 1 << 20
TOLERANCE = 300


def read_file(name):
    with open(os.environ[name], encoding="utf-8") as handle:
        return handle.read().strip()


SECRET = read_file("RELAY_SECRET_FILE")
KEY = base64.b64decode(SECRET.removeprefix("whsec_") + "==")
CHAT_URL = read_file("CHAT_URL_FILE")


def authentic(headers, body):
    """The Standard Webhooks check: HMAC-SHA256 of "id.timestamp.body", in time."""
    msg_id = headers.get("webhook-id", "")
    stamp = headers.get("webhook-timestamp", "")
    if not stamp.isdigit() or abs(time.time() - int(stamp)) > TOLERANCE:
        return False
    signed = f"{msg_id}.{stamp}.".encode() + body
    expected = base64.b64encode(hmac.new(KEY, signed, hashlib.sha256).digest()).decode()
    offered = [s.split(",", 1)[-1] for s in headers.get("webhook-signature", "").split()]
    return any(hmac.compare_digest(expected, s) for s in offered)


def message(delivery):
    if delivery.get("kind") == "approval_request":
        arguments = json.dumps(delivery["arguments"], indent=2)
        text = (
            f"*Approval needed* for `{delivery['tool']}` in session {delivery['session']}\n"
            f"```{arguments}```\nexpires {delivery['expires_at']}\n"
        )
        if delivery.get("approve_url"):
            text += f"<{delivery['approve_url']}|Approve> · <{delivery['deny_url']}|Deny>"
        else:
            text += f"decide with: agentgate approvals approve|deny {delivery['approval_id']}"
        return text
    output = delivery.get("output") or delivery.get("error") or ""
    return f"{delivery.get('status')}: session {delivery.get('session')}: {output[:1500]}"


class Relay(BaseHTTPRequestHandler):
    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        if length > MAX_BODY:
            self.send_error(413)
            return
        body = self.rfile.read(length)
        if not authentic(self.headers, body):
            self.send_error(401)
            return
        text = message(json.loads(body))
        request = urllib.request.Request(
            CHAT_URL,
            data=json.dumps({"text": text}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except OSError as err:
            # A failure answers 502, so agentgate retries the delivery later.
            self.send_error(502, str(err))
            return
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    host, port = os.environ.get("RELAY_LISTEN", "127.0.0.1:9100").rsplit(":", 1)
    ThreadingHTTPServer((host, int(port)), Relay).serve_forever()
