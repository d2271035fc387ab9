"""Lane demultiplexing (proxy/core/demux.py) as transcripts and a property test over
interleavings of refusals, errors and events on one socket: an event reaches the
response it belongs to, or every response in flight fails at once; never the wrong one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.core.demux import Demux, LaneSignal, LaneSupport, Routed, Stray, Unroutable

REFUSAL = {
    "type": "error",
    "status": 400,
    "error": {
        "type": "invalid_request_error",
        "code": "unknown_parameter",
        "message": "Unknown parameter: 'stream_id'.",
        "param": "stream_id",
    },
}


def ev(kind: str, **more: Any) -> dict[str, Any]:
    return {"type": kind, **more}


def test_the_lost_response_of_issue_23_cannot_happen() -> None:
    """A default-lane response in flight, then a named create on the same unproven socket: the
    planner may not send it (may_send), and if it were sent anyway, the refusal and the default
    lane's events cannot be told apart: both fail at once, nobody waits for events gone elsewhere."""
    d = Demux()
    assert d.may_send(None)
    d.sent(None)
    assert d.route(None, ev("response.created")) == Routed(None)
    assert not d.may_send("u1")  # unproven and busy: one response at a time
    d.sent("u1")  # recorded anyway, as the socket did send it
    refused = d.route(None, REFUSAL)
    assert isinstance(refused, Unroutable) and set(refused.lanes) == {None, "u1"}


def test_a_named_probe_on_an_idle_socket_proves_lanes() -> None:
    d = Demux()
    assert d.may_send("u1")
    d.sent("u1")
    assert d.route("u1", ev("response.created")) == Routed("u1", LaneSignal.PROVEN)
    assert d.support is LaneSupport.PROVEN and d.may_send(None)
    d.sent(None)
    assert d.route(None, ev("response.created")) == Routed(None)  # default lane: no stream_id
    assert d.route("u1", ev("response.completed")) == Routed("u1")
    d.done("u1")
    assert d.route("u1", ev("response.output_text.delta")) == Stray()  # a late event: dropped
    d.done(None)
    assert isinstance(d.route(None, ev("error")), Stray)


def test_a_refused_probe_refuses_lanes_and_the_socket_stays_one_at_a_time() -> None:
    d = Demux()
    d.sent("u1")
    assert d.route(None, REFUSAL) == Routed("u1", LaneSignal.REFUSED)
    d.done("u1")
    assert d.support is LaneSupport.REFUSED and d.may_send(None)
    d.sent(None)
    assert not d.may_send("u2")


def test_an_upstream_that_ignores_stream_id_is_noticed() -> None:
    d = Demux()
    d.sent("u1")
    assert d.route(None, ev("response.created")) == Routed("u1", LaneSignal.IGNORED)
    assert d.route(None, ev("response.completed")) == Routed("u1")
    assert d.support is LaneSupport.IGNORED


def test_a_connection_level_error_on_proven_named_lanes_fails_them_all() -> None:
    d = Demux()
    d.sent("u1")
    d.route("u1", ev("response.created"))
    d.sent("u2")
    got = d.route(None, ev("error", error={"code": "websocket_connection_limit_reached"}))
    assert isinstance(got, Unroutable) and got.lanes == ("u1", "u2")


# -- the property -------------------------------------------------------------------------------


@dataclass
class Upstream:
    """A reference upstream for one socket: ``lanes`` multiplexes by stream_id (events of
    different lanes interleave); ``reject`` refuses any stream_id at once (an error without
    stream_id, the socket usable) and runs default-lane creates FIFO; ``ignore`` runs every create
    FIFO and never echoes stream_id."""

    mode: str
    running: dict[str | None, list[dict[str, Any]]] = field(default_factory=dict)
    queue: list[tuple[str | None, list[dict[str, Any]]]] = field(default_factory=list)
    out: list[tuple[str | None, dict[str, Any]]] = field(default_factory=list)
    """Events ready to be sent, with the stream_id they carry."""

    def create(self, lane: str | None, tag: int, n: int, fails: bool) -> None:
        body = [ev("response.created", tag=tag)] + [ev("response.output_text.delta", tag=tag)] * n
        body.append(
            ev("error", tag=tag, error={"code": "server_error"}) if fails else ev("response.completed", tag=tag)
        )
        if lane is not None and self.mode == "reject":
            self.out.append((None, {**REFUSAL, "tag": tag}))
            return
        if self.mode == "lanes":
            self.queue.append((lane, body))
        else:
            self.queue.append((None, body))

    def ready(self) -> list[str | None]:
        """Lanes that may emit their next event now."""
        if self.mode == "lanes":
            lanes: list[str | None] = []
            for lane, _ in self.queue:
                if lane not in lanes:
                    lanes.append(lane)
            return lanes
        return [None] if self.queue else []

    def emit(self, lane: str | None) -> tuple[str | None, dict[str, Any]]:
        index = next(i for i, (ln, _) in enumerate(self.queue) if ln == lane)
        _, body = self.queue[index]
        event = body.pop(0)
        if not body:
            del self.queue[index]
        return (lane if self.mode == "lanes" else None), event


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["lanes", "reject", "ignore"]),
    creates=st.lists(
        st.tuples(st.sampled_from([None, "u1", "u2", "u3"]), st.integers(0, 3), st.booleans()), min_size=1, max_size=8
    ),
    schedule=st.lists(st.integers(0, 1000), max_size=120),
    obey=st.booleans(),
)
def test_every_event_reaches_its_response_or_every_response_fails(
    mode: str, creates: list[tuple[str | None, int, bool]], schedule: list[int], obey: bool
) -> None:
    """Interleavings of sends, refusals, errors and events on one socket. With ``obey`` the
    sidecar sends only what :meth:`Demux.may_send` allows (the planner's rule): then nothing is
    ever unroutable. Without it (a broken caller), an event is still never misrouted: it goes to
    its own response, or all responses in flight fail at once."""
    d, up = Demux(), Upstream(mode)
    owner: dict[int, str | None] = {}  # tag -> lane the sidecar sent it on
    inflight: dict[str | None, int] = {}  # lane -> tag
    pending = list(enumerate(creates))
    steps = iter(schedule + [0] * 400)
    while pending or up.out or up.ready():
        choice = next(steps)
        can_send = bool(pending) and pending[0][1][0] not in inflight and (d.may_send(pending[0][1][0]) or not obey)
        ready = up.ready()
        if can_send and (choice % 2 == 0 or not (up.out or ready)):
            tag, (lane, n, fails) = pending.pop(0)
            d.sent(lane)
            owner[tag], inflight[lane] = lane, tag
            up.create(lane, tag, n, fails)
            continue
        if up.out:
            sid, event = up.out.pop(0)
        elif ready:
            sid, event = up.emit(ready[choice % len(ready)])
        else:
            # Nothing to read, and the next create may not go out yet: a sidecar that obeys
            # waits for its in-flight responses to end, which they do above; this is a stall.
            assert not obey or not pending, "the rule left a create that can never be sent"
            return
        route = d.route(sid, event)
        tag = event["tag"]
        if isinstance(route, Unroutable):
            assert not obey, f"unroutable although the rule was kept: {route}"
            assert owner[tag] in route.lanes  # its own response fails with the others
            return  # the socket retires
        assert isinstance(route, Routed), route  # a tag is always in flight here
        assert route.lane == owner[tag], (route, owner[tag], event)
        if event["type"] in ("response.completed", "error"):
            d.done(route.lane)
            del inflight[route.lane]
    assert not inflight
