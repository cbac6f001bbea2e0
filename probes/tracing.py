"""OpenTelemetry tracing: one trace per request, one span per layer phase.

Without OTLP the rows are made directly (the same columns, ids drawn the way the SDK
draws them), no SDK span objects. Spans are made after the fact from lifecycle timestamps (never per token), so the
step loop pays nothing for them. ``RequestTracer.trace_request`` turns a request's
phases into a root span plus one child per phase; the ``SpanRowExporter`` flattens
finished spans into rows of ``schema.SPANS``. With OTLP on (``otlp=True`` or
``OTEL_EXPORTER_OTLP_ENDPOINT`` set) the same spans also go to a collector; the
exporter package is imported only then.

Clocks: our timestamps are ``time.monotonic_ns()``; OTel wants epoch ns. Spans are
created at ``monotonic + offset`` (offset sampled once) and the row exporter
subtracts it again, so spans.parquet stays on the bundle's monotonic clock.

A W3C ``traceparent`` given for a request makes its root span a child of that remote
span (same trace id): the gateway passes its own root's traceparent to a replica in
another process, and both halves land in one trace.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from typing import Any, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from layerscope.probes.requests import Phase

logger = logging.getLogger(__name__)

LAYER_ATTR = "layerscope.layer"
REQUEST_ATTR = "layerscope.request_id"
_PROPAGATOR = TraceContextTextMapPropagator()


class SpanRowExporter(SpanExporter):
    """Collects finished spans as tuples in ``schema.SPANS`` column order."""

    def __init__(self, clock_offset_ns: int):
        self.rows: list[tuple] = []
        self._offset = clock_offset_ns

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        off = self._offset
        for s in spans:
            attrs = dict(s.attributes or {})
            layer = attrs.pop(LAYER_ATTR, None)
            rid = attrs.pop(REQUEST_ATTR, None)
            parent = s.parent
            self.rows.append((
                f"{s.context.trace_id:032x}",
                f"{s.context.span_id:016x}",
                f"{parent.span_id:016x}" if parent is not None else None,
                s.name,
                layer or None,
                rid,
                s.start_time - off,
                s.end_time - off,
                json.dumps(attrs, sort_keys=True, default=str),
            ))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def otlp_requested(flag: bool | None) -> bool:
    """OTLP export on: an explicit flag wins, else whether OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is set."""
    if flag is not None:
        return flag
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def make_otlp_exporter() -> SpanExporter:
    """The OTLP span exporter (HTTP/protobuf, else gRPC); endpoint from the OTEL_* environment."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise RuntimeError(
                "OTLP trace export was requested (OTEL_EXPORTER_OTLP_ENDPOINT is set or otlp=True), but "
                "the OTLP exporter is not installed; install layerscope's otlp extra "
                "(pip install 'layerscope[otlp]') or unset OTEL_EXPORTER_OTLP_ENDPOINT"
            ) from None
    return OTLPSpanExporter()


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def _rand_id(bits: int) -> int:
    return random.getrandbits(bits) or 1


def _parse_traceparent(traceparent: str | None) -> tuple[str, str | None]:
    """(trace id, parent span id) from a W3C traceparent; a new trace id and no parent without one."""
    if traceparent:
        m = _TRACEPARENT.fullmatch(traceparent.strip().lower())
        if m and int(m.group(1), 16) and int(m.group(2), 16):
            return m.group(1), m.group(2)
        logger.warning("ignoring malformed traceparent %r", traceparent)
    return f"{_rand_id(128):032x}", None


def format_traceparent(span: trace.Span) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


class RequestTracer:
    """Makes each request's trace from its phases; keeps the flattened rows."""

    def __init__(self, service_name: str = "layerscope", replica: str | int = 0, otlp: bool | None = None):
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()
        self.exporter = SpanRowExporter(self.clock_offset_ns)
        resource = Resource.create({"service.name": service_name, "layerscope.replica": str(replica)})
        self.provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.otlp = False
        if otlp_requested(otlp):
            try:
                self.provider.add_span_processor(BatchSpanProcessor(make_otlp_exporter()))
                self.otlp = True
            except RuntimeError as e:
                if otlp:  # asked for explicitly: an error
                    raise
                logger.warning("%s; traces go to the bundle only", e)
        self.tracer = self.provider.get_tracer("layerscope.probes")
        self._open: dict[str, trace.Span] = {}

    @property
    def rows(self) -> list[tuple]:
        return self.exporter.rows

    def _parent_context(self, traceparent: str | None):
        if not traceparent:
            return None
        ctx = _PROPAGATOR.extract({"traceparent": traceparent})
        if not trace.get_current_span(ctx).get_span_context().is_valid:
            logger.warning("ignoring malformed traceparent %r", traceparent)
            return None
        return ctx

    def trace_request(self, request_id: str, root: Phase, phases: list[Phase], traceparent: str | None = None) -> str:
        """Create ``root`` (child of ``traceparent`` when given) and ``phases`` under it; return the trace id (hex)."""
        if not self.otlp:  # rows only: no SDK span objects (a tenth of the time)
            trace_id, parent = _parse_traceparent(traceparent)
            root_id = self._row(request_id, root, trace_id, parent)
            for p in phases:
                self._row(request_id, p, trace_id, root_id)
            return trace_id
        off = self.clock_offset_ns
        span = self._start(request_id, root, self._parent_context(traceparent))
        ctx = trace.set_span_in_context(span)
        for p in phases:
            child = self._start(request_id, p, ctx)
            child.end(end_time=max(p.end_ns, p.start_ns) + off)
        span.end(end_time=max(root.end_ns, root.start_ns) + off)
        return f"{span.get_span_context().trace_id:032x}"

    def _row(self, request_id: str, p: Phase, trace_id: str, parent: str | None,
             attributes: dict[str, Any] | None = None) -> str:
        """Append the span row of ``p`` (what SpanRowExporter makes of an SDK span); return its span id."""
        span_id = f"{_rand_id(64):016x}"
        attrs = {**p.attributes, **attributes} if attributes else p.attributes
        self.exporter.rows.append((trace_id, span_id, parent, p.name, p.layer or None, request_id, p.start_ns,
                                   max(p.end_ns, p.start_ns), json.dumps(attrs, sort_keys=True, default=str)))
        return span_id

    def _start(self, request_id: str, p: Phase, ctx) -> trace.Span:
        attrs = {REQUEST_ATTR: request_id, **p.attributes}
        if p.layer:
            attrs[LAYER_ATTR] = p.layer
        return self.tracer.start_span(p.name, context=ctx, start_time=p.start_ns + self.clock_offset_ns,
                                      attributes=attrs)

    # ---- a root span opened early: the gateway hands its traceparent to a replica ----
    def open_root(self, request_id: str, name: str, start_ns: int, traceparent: str | None = None) -> str:
        """Start ``request_id``'s root span now; return its traceparent to pass downstream."""
        if not self.otlp:
            trace_id, parent = _parse_traceparent(traceparent)
            span_id = f"{_rand_id(64):016x}"
            self._open[request_id] = (trace_id, span_id, parent, name, start_ns)
            return f"00-{trace_id}-{span_id}-01"
        span = self._start(request_id, Phase(name, None, start_ns, start_ns), self._parent_context(traceparent))
        self._open[request_id] = span
        return format_traceparent(span)

    def close_root(self, request_id: str, end_ns: int, phases: list[Phase],
                   attributes: dict[str, Any] | None = None) -> str | None:
        """Add ``phases`` under the open root and end it; return the trace id (None if none was open)."""
        span = self._open.pop(request_id, None)
        if span is None:
            return None
        if isinstance(span, tuple):  # opened without OTLP: rows only
            trace_id, span_id, parent, name, start_ns = span
            for p in phases:
                self._row(request_id, p, trace_id, span_id)
            self.exporter.rows.append((trace_id, span_id, parent, name, None, request_id, start_ns,
                                       max(end_ns, start_ns), json.dumps(attributes or {}, sort_keys=True, default=str)))
            return trace_id
        off = self.clock_offset_ns
        ctx = trace.set_span_in_context(span)
        for p in phases:
            self._start(request_id, p, ctx).end(end_time=max(p.end_ns, p.start_ns) + off)
        if attributes:
            span.set_attributes(attributes)
        span.end(end_time=end_ns + off)
        return f"{span.get_span_context().trace_id:032x}"

    def shutdown(self) -> None:
        for rid in list(self._open):  # roots never closed (request lost): end them now
            span = self._open.pop(rid)
            if isinstance(span, tuple):
                self.close_root(rid, time.monotonic_ns(), [])
                continue
            span.end()
        self.provider.shutdown()
