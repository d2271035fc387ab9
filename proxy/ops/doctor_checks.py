"""The doctor's checks: one scripted conversation, each step judged as one line.

The run, in order (each step is skipped once ``--max-requests`` is spent):

1. ``http``: ``POST /v1/responses`` (with ``--service-tier``, whose answer is ``service_tier``).
2. ``websocket``: socket A opens and answers a first turn (stored, with a context of a few KiB).
3. ``continuation``: the second turn on socket A, ``previous_response_id`` and the new item
   only; then the same context in full over HTTP (streamed), and the two times to first output.
4. ``store_false``: on socket A, a ``store: false`` response, then its continuation.
5. ``lanes``: on socket A, a create on a named ``stream_id`` lane; the socket's demultiplexer
   says whether the upstream took it. Socket A then closes.
6. ``hydration``: socket B continues the stored second turn (nothing of it is on socket B).
7. ``compact``: ``POST /v1/responses/compact``.
8. ``via``: two turns through the sidecar as an app sends them (full history each time), the
   second answered as a continuation (``x-upshift-mode``); the response it made is read back
   from the upstream with the doctor's key (same upstream, same credential); the admin port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from proxy.config import Settings, parse_hostport
from proxy.core.demux import LaneSignal
from proxy.core.retry import error_fields
from proxy.errors import UpstreamError, UpstreamRefused
from proxy.intake.keys import KeySource
from proxy.ops.doctor_report import Check, Result, Status
from proxy.ops.doctor_via import via_check
from proxy.ops.doctor_wire import Answer, Budget, Upstream
from proxy.redact import redact_url
from proxy.upstream.ws import UpstreamSocket

__all__ = ["Checks", "Options"]


@dataclass(frozen=True, slots=True)
class Options:
    """What the command line asked for."""

    model: str
    max_requests: int
    max_output_tokens: int
    service_tier: str | None
    query: str
    """The app's query string (``api-version=...``)."""
    via: str | None
    via_admin: str | None
    timeout: float


_CONTEXT = (
    "This paragraph stands in for the history of an agent's conversation, so that a full send "
    "has a context of a few KiB to upload and read again while a continuation has only its "
    "newest message. "
) * 24
_LANE = "upshift-doctor"
_SPENT = "--max-requests reached"
_REFUSED_HINTS = {
    401: "the key was refused on the upgrade: check the key the sidecar sends (api_key.*, identity.headers)",
    403: "a proxy or gateway on the way forbids WebSocket upgrades, or the key may open no more sockets: "
    "allow upgrades to the upstream, or run the sidecar with mode: http",
    404: "no WebSocket mode at this URL: check upstream (Azure's path is /openai/v1)",
    426: "a proxy or gateway on the way does not pass WebSocket upgrades: allow them to the upstream, "
    "or run the sidecar with mode: http (every turn then goes over HTTP)",
    429: "the key's sockets are at the upstream's cap (running sidecars may hold them): try again later, "
    "and keep pool.max_sockets_per_identity below the cap",
}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _admin_url(via: str, admin_listen: str) -> str:
    """The admin URL of the sidecar at ``via``: its host, the configured admin port."""
    host = urlsplit(via).hostname or "127.0.0.1"
    _, port = parse_hostport(admin_listen)
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _unavailable_hint(message: str) -> str:
    lowered = message.lower()
    if "certificate" in lowered or "tls" in lowered or "ssl" in lowered:
        return "trust the CA that signs the upstream's certificate (or the inspecting proxy's): egress.ca_file"
    if "egress proxy" in lowered:
        return "the egress proxy refuses or is unreachable: check egress.proxy (HTTPS_PROXY) and its allow-list"
    return "check upstream, DNS and egress.proxy (HTTPS_PROXY, NO_PROXY)"


def _refusal(exc: UpstreamRefused) -> str:
    """The upstream's own words for a refused upgrade, if its body has them."""
    text = exc.payload.decode("utf-8", "replace").strip()
    try:
        body = orjson.loads(exc.payload)
    except orjson.JSONDecodeError:
        body = None
    message = error_fields(body)[1] if isinstance(body, dict) else None
    said = message or text[:200]
    return f"the upgrade on /v1/responses was refused with HTTP {exc.http_status}" + (f": {said}" if said else "")


class Checks:
    """One run of the doctor against ``settings.upstream`` (and ``options.via``).

    Args:
        settings: The sidecar's settings.
        keys: Its key source.
        app_headers: What an app sends (its credential, in passthrough mode).
        options: The command line's choices.
    """

    def __init__(self, settings: Settings, keys: KeySource, app_headers: Mapping[str, str], options: Options) -> None:
        self.settings = settings
        self.options = options
        self.app_headers = dict(app_headers)
        self.budget = Budget(options.max_requests)
        self.up = Upstream(settings, keys, app_headers, options.query, options.timeout, self.budget)
        self.path = self.up.describe_path()
        self.results: dict[Check, Result] = {}
        self._reached = False
        """The upstream answered over HTTP (with any status): else ``compact`` is not tried."""
        self._first = Answer()
        """The first turn on socket A (its output is the full send's history)."""

    @property
    def requests_sent(self) -> int:
        return self.budget.sent

    def _body(self, items: list[Any], *, store: bool = True, **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.options.model,
            "input": items,
            "max_output_tokens": self.options.max_output_tokens,
            "store": store,
        }
        body.update(extra)
        return body

    async def run(self) -> dict[Check, Result]:
        """Every check, in order; the results by check (``via`` only with ``--via``)."""
        async with self.up:
            await self._http()
            sock = await self._websocket()
            stored = ""
            if sock is not None:
                try:
                    stored = await self._continuation(sock)
                    await self._store_false(sock)
                    await self._lanes(sock)
                finally:
                    await sock.close()
            else:
                why = "no socket (see websocket)"
                for check in (Check.CONTINUATION, Check.STORE_FALSE, Check.LANES):
                    self.results[check] = Result(Status.SKIP, why)
                self.results[Check.LANES].fields["supported"] = None
                self.results[Check.CONTINUATION].fields.update(full_first_event_ms=None, continued_first_event_ms=None)
            await self._hydration(stored, sock is not None)
            await self._compact()
            if self.options.via:
                admin = self.options.via_admin or _admin_url(self.options.via, self.settings.admin_listen)
                self.results[Check.VIA] = await via_check(
                    self.up, self.options.via, admin, self._body, self.app_headers
                )
        order = list(Check)
        return dict(sorted(self.results.items(), key=lambda kv: order.index(kv[0])))

    # -- HTTP ----------------------------------------------------------------------------------

    async def _http(self) -> None:
        tier = self.options.service_tier
        extra = {"service_tier": tier} if tier else {}
        body = self._body([_user("Reply with one word: ok.")], store=False, **extra)
        answer = await self.up.request("POST", "/v1/responses", body)
        tier_fields: dict[str, Any] = {"requested": tier, "served": None}
        code, _, param = answer.error()
        if answer.failure:
            hint = "" if answer.unsent else _unavailable_hint(answer.failure)
            self.results[Check.HTTP] = Result(Status.FAIL, f"POST /v1/responses got no answer: {answer.failure}", hint)
            self.results[Check.SERVICE_TIER] = Result(Status.SKIP, "no HTTP answer", fields=tier_fields)
            return
        self._reached = True
        took = f"in {answer.total_ms:.0f} ms ({self.path})"
        if answer.status == 200 and answer.response is not None:
            self.results[Check.HTTP] = Result(Status.PASS, f"POST /v1/responses answered HTTP 200 {took}")
            served = answer.response.get("service_tier")
            tier_fields["served"] = served
            if not tier:
                detail = f"served {served!r} (none asked for; --service-tier asks for one)"
                self.results[Check.SERVICE_TIER] = Result(Status.PASS, detail, fields=tier_fields)
            elif served == tier or tier == "auto":
                self.results[Check.SERVICE_TIER] = Result(
                    Status.PASS, f"asked for {tier!r}, served {served!r}", fields=tier_fields
                )
            else:
                detail = f"asked for {tier!r}, served {served!r}: the tier fell back"
                hint = "the response's service_tier is what is billed and rate-limited"
                self.results[Check.SERVICE_TIER] = Result(Status.WARN, detail, hint, tier_fields)
            return
        if param == "service_tier":
            self.results[Check.HTTP] = Result(Status.PASS, f"POST /v1/responses answered HTTP {answer.status} {took}")
            detail = f"asked for {tier!r}: {answer.describe()}"
            self.results[Check.SERVICE_TIER] = Result(
                Status.FAIL, detail, "ask for a tier this model and key have", tier_fields
            )
            return
        hint = {
            401: "the key was refused: passthrough mode sends OPENAI_API_KEY, else api_key.file / api_key.env",
            403: "the key may not use this model or endpoint",
            404: "check upstream (its path prefix) and --model",
            429: "the key is rate-limited or out of quota",
        }.get(answer.status or 0, "")
        if code in ("model_not_found",) or param == "model":
            hint = "choose a model this key may use with --model"
        self.results[Check.HTTP] = Result(Status.FAIL, f"POST /v1/responses answered {answer.describe()} {took}", hint)
        self.results[Check.SERVICE_TIER] = Result(Status.SKIP, "no HTTP response", fields=tier_fields)

    # -- sockets -------------------------------------------------------------------------------

    async def _open(self) -> UpstreamSocket | UpstreamError:
        """A socket, or why not: a 429 is tried again once, after its ``retry-after``."""
        try:
            return await self.up.open_socket()
        except UpstreamRefused as exc:
            if exc.http_status != 429:
                return exc
            try:
                wait = float(exc.headers.get("retry-after", "1"))
            except ValueError:
                wait = 1.0
            await asyncio.sleep(min(max(wait, 0.0), 5.0))
            try:
                return await self.up.open_socket()
            except UpstreamError as again:
                return again
        except UpstreamError as exc:
            return exc

    def _socket_failure(self, exc: UpstreamError) -> tuple[str, str]:
        if isinstance(exc, UpstreamRefused):
            return _refusal(exc), _REFUSED_HINTS.get(exc.http_status, "")
        return f"the upgrade on /v1/responses failed: {exc}", _unavailable_hint(str(exc))

    async def _websocket(self) -> UpstreamSocket | None:
        if self.budget.sent >= self.budget.limit:
            self.results[Check.WEBSOCKET] = Result(Status.SKIP, f"not tried: {_SPENT}")
            return None
        opened = await self._open()
        if isinstance(opened, UpstreamError):
            detail, hint = self._socket_failure(opened)
            refused = opened.http_status if isinstance(opened, UpstreamRefused) else None
            fields = {"http_status": refused} if refused is not None else {}
            # A 429 is the upstream itself refusing one more socket for this key (running
            # sidecars may hold them all): the way there works, the socket checks wait.
            status = Status.WARN if refused == 429 else Status.FAIL
            self.results[Check.WEBSOCKET] = Result(status, f"{detail} ({self.path})", hint, fields)
            return None
        self._first = await self.up.turn(opened, self._body([_user(_CONTEXT + "Reply with one word: ok.")]))
        if not self._first.answered:
            detail = f"upgraded ({self.path}), but the first response.create got {self._first.describe()}"
            self.results[Check.WEBSOCKET] = Result(Status.FAIL, detail)
            await opened.close()
            return None
        url = redact_url(self.up.identity.ws_url)
        detail = f"upgraded on {url} ({self.path}); a first turn answered in {self._first.total_ms:.0f} ms"
        self.results[Check.WEBSOCKET] = Result(Status.PASS, detail)
        return opened

    async def _continuation(self, sock: UpstreamSocket) -> str:
        """The continuation check; returns the stored response to hydrate later ("" if none)."""
        first = self._first
        fields: dict[str, Any] = {"full_first_event_ms": None, "continued_first_event_ms": None}
        new = _user("And once more: reply with one word: ok.")
        answer = await self.up.turn(sock, self._body([new], previous_response_id=first.response_id))
        if not answer.answered:
            status = Status.SKIP if answer.unsent else Status.FAIL
            detail = f"the second turn (previous_response_id and one new item) got {answer.describe()}"
            hint = (
                ""
                if status is Status.SKIP
                else "the upstream does not continue on the socket: run the sidecar with mode: http"
            )
            self.results[Check.CONTINUATION] = Result(status, detail, hint, fields)
            return first.response_id
        fields["continued_first_event_ms"] = round(answer.first_output_ms or answer.total_ms, 1)
        output = (first.response or {}).get("output") or []
        full_items = [_user(_CONTEXT + "Reply with one word: ok."), *output, new]
        full = await self.up.request("POST", "/v1/responses", self._body(full_items, store=False, stream=True))
        detail = f"continued on the socket in {answer.total_ms:.0f} ms with the new item only"
        if full.first_output_ms is not None and full.answered:
            fields["full_first_event_ms"] = round(full.first_output_ms, 1)
            saving = fields["full_first_event_ms"] - fields["continued_first_event_ms"]
            fields["saving_ms"] = round(saving, 1)
            detail += (
                f"; first output after {fields['continued_first_event_ms']:.0f} ms against "
                f"{fields['full_first_event_ms']:.0f} ms for the same context sent in full over HTTP: "
                f"{saving:+.0f} ms a turn on this network"
            )
        else:
            detail += f"; the full send over HTTP for comparison got {full.describe()}"
        self.results[Check.CONTINUATION] = Result(Status.PASS, detail, fields=fields)
        return answer.response_id

    async def _store_false(self, sock: UpstreamSocket) -> None:
        made = await self.up.turn(sock, self._body([_user("Reply with one word: ok.")], store=False))
        if not made.answered:
            self.results[Check.STORE_FALSE] = self._not_answered("a store:false response", made)
            return
        body = self._body([_user("Again: ok.")], store=False, previous_response_id=made.response_id)
        answer = await self.up.turn(sock, body)
        if answer.answered:
            detail = f"a store:false response was continued on its own socket in {answer.total_ms:.0f} ms"
            self.results[Check.STORE_FALSE] = Result(Status.PASS, detail)
            return
        result = self._not_answered("the continuation of a store:false response on its socket", answer)
        if result.status is Status.FAIL:
            result.hint = "store:false conversations are sent in full every turn here: consider store:true"
        self.results[Check.STORE_FALSE] = result

    async def _lanes(self, sock: UpstreamSocket) -> None:
        answer = await self.up.turn(sock, self._body([_user("Reply with one word: ok.")], store=False), lane=_LANE)
        fields: dict[str, Any] = {"supported": None}
        if answer.unsent:
            self.results[Check.LANES] = Result(Status.SKIP, f"not tried: {_SPENT}", fields=fields)
            return
        hint = "the sidecar finds this out itself; pool.lanes_per_socket: 1 spares it the probe"
        if answer.signal is LaneSignal.PROVEN:
            fields["supported"] = True
            detail = f"a create on stream_id {_LANE!r} was answered on its lane in {answer.total_ms:.0f} ms"
            self.results[Check.LANES] = Result(Status.PASS, detail, fields=fields)
        elif answer.signal is LaneSignal.REFUSED:
            fields["supported"] = False
            fields["error"] = (answer.body or {}).get("error")  # the upstream's own words, whole
            detail = f"the upstream refused stream_id: {answer.describe()}"
            self.results[Check.LANES] = Result(Status.WARN, detail, hint, fields)
        elif answer.signal is LaneSignal.IGNORED:
            fields["supported"] = False
            detail = "the upstream answered a stream_id create without stream_id: it ignores lanes (one at a time)"
            self.results[Check.LANES] = Result(Status.WARN, detail, hint, fields)
        elif answer.close_code is not None:
            fields["supported"] = False
            detail = f"the upstream closed the socket on a stream_id create: {answer.failure}"
            self.results[Check.LANES] = Result(Status.WARN, detail, hint, fields)
        else:
            detail = f"a stream_id create got {answer.describe()}"
            self.results[Check.LANES] = Result(Status.WARN, detail, fields=fields)

    async def _hydration(self, stored: str, have_socket: bool) -> None:
        if not have_socket:
            self.results[Check.HYDRATION] = Result(Status.SKIP, "no socket (see websocket)")
            return
        if not stored:
            self.results[Check.HYDRATION] = Result(Status.SKIP, "no stored response on a socket to continue")
            return
        if self.budget.sent >= self.budget.limit:
            self.results[Check.HYDRATION] = Result(Status.SKIP, f"not tried: {_SPENT}")
            return
        opened = await self._open()
        if isinstance(opened, UpstreamError):
            detail, hint = self._socket_failure(opened)
            self.results[Check.HYDRATION] = Result(Status.WARN, f"a second socket: {detail}", hint)
            return
        try:
            answer = await self.up.turn(opened, self._body([_user("Once more: ok.")], previous_response_id=stored))
        finally:
            await opened.close()
        if answer.answered:
            detail = f"a stored response was continued from a new socket in {answer.total_ms:.0f} ms"
            self.results[Check.HYDRATION] = Result(Status.PASS, detail)
            return
        result = self._not_answered("a stored response continued from a new socket", answer)
        if result.status is Status.FAIL:
            result.status = Status.WARN
            result.hint = "after a lost socket the sidecar sends the conversation in full (it still works)"
        self.results[Check.HYDRATION] = result

    def _not_answered(self, what: str, answer: Answer) -> Result:
        if answer.unsent:
            return Result(Status.SKIP, f"not tried: {_SPENT}")
        return Result(Status.FAIL, f"{what} got {answer.describe()}")

    # -- compaction ------------------------------------------------------------------------------

    async def _compact(self) -> None:
        if not self._reached:
            self.results[Check.COMPACT] = Result(Status.SKIP, "the upstream is not reachable over HTTP (see http)")
            return
        body = {"model": self.options.model, "input": [_user("Reply with one word: ok.")]}
        answer = await self.up.request("POST", "/v1/responses/compact", body)
        if answer.failure:
            status = Status.SKIP if answer.unsent else Status.FAIL
            self.results[Check.COMPACT] = Result(status, f"POST /v1/responses/compact got no answer: {answer.failure}")
            return
        said = f"POST /v1/responses/compact answered {answer.describe()}"
        if answer.status == 200 and answer.body is not None and answer.body.get("object") == "response.compaction":
            items = len(answer.body.get("output") or [])
            self.results[Check.COMPACT] = Result(
                Status.PASS, f"POST /v1/responses/compact served a window of {items} item(s)"
            )
        elif answer.status in (401, 403) or (answer.status or 500) >= 500:
            self.results[Check.COMPACT] = Result(Status.FAIL, said)
        else:
            hint = "apps that compact get this answer through the sidecar too (it relays the route over HTTP)"
            if answer.status == 400:
                hint = "--model a model that compacts, if your apps compact"
            self.results[Check.COMPACT] = Result(Status.WARN, said, hint)
