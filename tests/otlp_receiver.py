"""A real OTLP/HTTP receiver on loopback, decoding requests with the official protobuf messages; and
collectors that misbehave (answer with an error, slowly, or never)."""

from __future__ import annotations

import base64
import gzip
import json
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.otlp_json import Span, spans_from_request

_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(request: dict) -> dict:
    # protobuf's JSON mapping writes bytes as base64; OTLP JSON writes ids as hex.
    for resource_spans in request.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for name in _ID_FIELDS:
                    if span.get(name):
                        span[name] = base64.b64decode(span[name]).hex()
    return request


class OtlpReceiver:
    def __init__(self, port: int = 0):
        self.trace_requests: list[dict] = []
        self.metric_requests: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    request = ExportTraceServiceRequest.FromString(body)
                    receiver.trace_requests.append(_hex_ids(MessageToDict(request)))
                    response = ExportTraceServiceResponse()
                elif self.path == "/v1/metrics":
                    request = ExportMetricsServiceRequest.FromString(body)
                    receiver.metric_requests.append(MessageToDict(request))
                    response = ExportMetricsServiceResponse()
                else:
                    self.send_error(404)
                    return
                payload = response.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        ThreadingHTTPServer.allow_reuse_address = True  # a restarted receiver takes its old port back
        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def spans(self) -> list[Span]:
        return [span for request in self.trace_requests for span in spans_from_request(request)]

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


class Misbehaving:
    """A loopback HTTP server answering every request after ``delay`` seconds with ``status``;
    ``status=None`` accepts connections, reads the request and never answers."""

    def __init__(self, status: int | None, delay: float = 0.0):
        self.requests = 0
        self.bodies: list[tuple[str, bytes]] = []  # (path, request body), as received
        outer = self
        hold = threading.Event()
        self._hold = hold

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                outer.bodies.append((self.path, body))
                outer.requests += 1
                if status is None:
                    hold.wait()
                    return
                time.sleep(delay)
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self):
        self._hold.set()
        self._server.shutdown()
        self._server.server_close()


class SilentSocket:
    """A loopback port that accepts connections and never reads or writes: a black hole for any
    protocol (OTLP/gRPC waits for the HTTP/2 handshake until its deadline)."""

    def __init__(self):
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(64)
        self._accepted: list[socket.socket] = []
        self._closed = threading.Event()
        self.endpoint = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._closed.is_set():
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            self._accepted.append(connection)

    def close(self):
        self._closed.set()
        self._socket.close()
        for connection in self._accepted:
            connection.close()


def serve(answer):
    """A loopback HTTP server answering GETs with ``answer(url) -> (status, body)``: JSON, or bytes as they are
    (a backend's API, as diagnose queries it). Returns the server and its base URL."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answer(urllib.parse.urlsplit(self.path))
            payload = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
