"""A reward server in a thread (http.server), for the --rm-url tests: each answer from a function of the body."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class RewardServer:
    """A reward server in a thread; ``reply(body) -> (status, bytes)`` decides each answer."""

    def __init__(self, reply, port=0):
        self.bodies = []
        self.reply = reply
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                status, payload = outer.reply(body)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
