"""Whether the upstream takes named lanes, as a transcript of what sockets learned."""

from __future__ import annotations

from proxy.core.demux import LaneSignal
from proxy.core.lanes import EARLY_CLOSES_TO_REFUSE, LANES_RETRY_SECONDS, LaneProof


def test_a_refusal_turns_named_lanes_off_for_a_while_and_is_not_extended() -> None:
    proof = LaneProof(lanes_per_socket=8)
    assert proof.named
    assert proof.signal(LaneSignal.REFUSED, 10.0)  # a fallback
    assert not proof.named
    assert not proof.refused(20.0)  # already off: the window stays where it was
    proof.now = 10.0 + LANES_RETRY_SECONDS
    assert proof.named  # tried again


def test_early_closes_refuse_before_proof_and_only_a_run_of_them_after() -> None:
    proof = LaneProof(lanes_per_socket=8)
    assert proof.closed_early(1.0)  # nothing proven: a close before any event is a refusal
    proof.now = 1.0 + LANES_RETRY_SECONDS
    assert not proof.signal(LaneSignal.PROVEN, proof.now) and proof.proven
    for _ in range(EARLY_CLOSES_TO_REFUSE - 1):
        assert not proof.closed_early(proof.now)  # a lost socket, not a refusal
    assert proof.closed_early(proof.now) and not proof.proven


def test_one_lane_per_socket_never_names_lanes() -> None:
    proof = LaneProof(lanes_per_socket=1)
    assert not proof.named and not proof.refused(0.0)
