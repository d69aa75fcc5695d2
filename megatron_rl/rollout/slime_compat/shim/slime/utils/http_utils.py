"""slime's ``post`` / ``get``: JSON over HTTP to an SGLang-protocol server, retried as slime retries (once a
second, ``max_retries`` times). Standard library only: each call runs in a worker thread, so it works on any
event loop a function runs on."""

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request


def _request(url, payload, headers, method):
    data = None if method == "GET" else json.dumps(payload or {}).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy (slime's trust_env)
    with opener.open(req, timeout=None) as resp:
        raw = resp.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode()


def _post(url, payload, max_retries, headers):
    for attempt in range(1, max_retries + 1):
        try:
            return _request(url, payload, headers, "POST")
        except (urllib.error.URLError, OSError, ValueError):
            if attempt >= max_retries:
                raise
            time.sleep(1)
    raise RuntimeError(f"post {url}: max_retries={max_retries}")


async def post(url, payload, max_retries=60, headers=None):
    return await asyncio.to_thread(_post, url, payload, max(int(max_retries), 1), headers)


async def get(url):
    return await asyncio.to_thread(_request, url, None, None, "GET")


def is_port_available(port):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def find_available_port(base_port):
    port = base_port
    while not is_port_available(port):
        port += 1
    return port


def get_host_info():
    return socket.gethostname(), "127.0.0.1"


def get_rollout_num_engines(args) -> int:
    return int(getattr(args, "rollout_num_engines", None) or 1)


def init_http_client(args):
    """Nothing to set up: each call opens its own connection."""
