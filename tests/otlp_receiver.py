"""A real OTLP/HTTP receiver on loopback, decoding requests with the official protobuf messages."""

from __future__ import annotations

import base64
import gzip
import threading
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
