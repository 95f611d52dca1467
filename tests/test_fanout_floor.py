"""The fan-out baseline of benchmarks/scale.py (benchmarks/fanout_floor.py) runs end to end at a small
size: a real gRPC server with mutual TLS, two client processes, every stream written to and read,
directly or through relay processes."""

from __future__ import annotations

import pytest

from benchmarks.fanout_floor import measure_floor


def test_the_grpc_floor_writes_to_every_stream_and_every_client_reads_it() -> None:
    figures = measure_floor(120, clients=2, beats_per_second=240.0, rounds=2)
    assert figures["streams"] == 120 and figures["rounds"] == 2
    # Each round waits for the server's last write and for every stream's receipt (a lost one times
    # out), so figures exist only for rounds every stream completed.
    assert 0 < figures["write_all_s_p50"] < 30
    assert 0 < figures["receive_p99_s"] < 30
    assert figures["write_cpu_us_per_stream"] > 0
    assert figures["server_streams"] == 120
    # The whole machine's CPU over the round (every process's), beside the server's own.
    assert figures["machine_cpu_us_per_stream"] > 0 and figures["machine_busy_cores_p50"] > 0


def test_relays_carry_the_message_to_every_stream_in_two_hops() -> None:
    figures = measure_floor(90, clients=2, beats_per_second=180.0, rounds=2, relays=2)
    assert figures["streams"] == 90 and figures["relays"] == 2
    # The server held only the relays' streams, and every client stream still read each round's
    # message (a round waits for all 90 receipts, timed from the server's wake; a lost one times out).
    assert figures["server_streams"] == 2
    assert 0 < figures["receive_p99_s"] < 30
    assert figures["machine_cpu_us_per_stream"] > 0


@pytest.mark.parametrize("acks", ["unary", "stream"])
def test_every_acknowledgement_reaches_the_server_by_either_path(acks: str) -> None:
    figures = measure_floor(60, clients=2, beats_per_second=120.0, rounds=1, acks=acks, ack_delay=0.1)
    assert figures["acks"] == acks
    # Every one of them came by the path asked for, and none by the other.
    assert figures["acks_received"] == {acks: 60}
    # The round waits for all 60 acknowledgements (a lost one times out); they come at least
    # --ack-delay after the write, and the server spends CPU on them beyond the writes.
    assert 0.1 < float(figures["acked_all_s_p50"]) < 30
    assert float(figures["round_cpu_us_per_stream"]) > float(figures["write_cpu_us_per_stream"])
