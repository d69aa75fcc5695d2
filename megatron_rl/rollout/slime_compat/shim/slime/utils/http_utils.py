"""slime's ``post`` / ``get``: JSON over HTTP to an SGLang-protocol server, retried as slime retries (once a
second, ``max_retries`` times). Standard library only: each call runs in a worker thread, so it works on any
event loop a function runs on."""

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request


# seconds one request waits for the gateway's answer (a socket timeout, each connect and read): the run's
# --user-function-timeout once init_http_client saw its args, which also bounds the function's whole call
_timeout_s = 3600.0


def _request(url, payload, headers, method):
    data = None if method == "GET" else json.dumps(payload or {}).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy (slime's trust_env)
    with opener.open(req, timeout=_timeout_s) as resp:
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
    """Each call opens its own connection; what is set up is how long one may wait (``--user-function-timeout``,
    slime's client waits without a bound)."""
    global _timeout_s
    _timeout_s = float(getattr(args, "user_function_timeout", None) or _timeout_s)
