"""Tier 2: heartbeats in a real TCP store name the ranks that stopped beating (core/liveness.py)."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_pdist.core.liveness import Heartbeat, describe_silent_ranks, looks_like_a_lost_peer, silent_ranks


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield server.port  # port 0: the kernel's choice, read back
    del server


def test_a_rank_that_never_beat_or_stopped_beating_is_silent(store):
    """Rank 0 beats, rank 1 never does: [1]; once rank 0 stops too: [0, 1]."""
    beat = Heartbeat("127.0.0.1", store, rank=0, period=0.1)
    assert silent_ranks("127.0.0.1", store, world_size=2, wait=0.5) == [1]
    beat.stop()
    assert silent_ranks("127.0.0.1", store, world_size=2, wait=0.5) == [0, 1]


def test_the_description_names_the_silent_ranks_but_never_the_asking_rank(store):
    """Rank 2 beats, 0 and 1 do not; asked from rank 0, only rank 1 is named (rank 0 knows it is alive)."""
    beat = Heartbeat("127.0.0.1", store, rank=2, period=0.1)
    try:
        text = describe_silent_ranks("127.0.0.1", store, world_size=3, rank=0, wait=0.5)
    finally:
        beat.stop()
    assert text == "rank 1 has sent no heartbeat for 0.5 s (checked from rank 0): stopped, dead, or cut off from " \
                   f"127.0.0.1:{store}"  # fmt: skip


def test_when_every_rank_beats_the_description_says_one_is_hung_in_its_own_code(store):
    """Both ranks beat: nobody is stopped or dead; the description says a rank is hung or slow instead."""
    beats = [Heartbeat("127.0.0.1", store, rank=r, period=0.1) for r in range(2)]
    try:
        text = describe_silent_ranks("127.0.0.1", store, world_size=2, rank=0, wait=0.5)
    finally:
        for beat in beats:
            beat.stop()
    assert text.startswith("every rank's heartbeat still advances (checked for 0.5 s from rank 0): no rank is stopped")


def test_a_store_that_does_not_answer_is_named_with_its_host(master_port):
    """No store at the address: the description says so and points at the process hosting it (rank 0)."""
    port = master_port  # held, never listened on
    text = describe_silent_ranks("127.0.0.1", port, world_size=2, rank=1, wait=0.1, timeout=0.5)
    assert text.startswith(f"the job's store at 127.0.0.1:{port} does not answer (")
    assert text.endswith("the process that hosts it (global rank 0 under Lightning's launchers) is stopped, dead or unreachable")


@pytest.mark.parametrize(
    "error, lost",
    [
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation"), True),
        (RuntimeError("Application timeout caused pair closure"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:53386."), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2474: Connection reset by peer."), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("Timed out waiting"), False),
    ],
)
def test_which_errors_look_like_a_lost_peer(error, lost):
    """gloo's timeout and closed/reset connection errors are lost peers; a user's own error is not."""
    assert looks_like_a_lost_peer(error) is lost


def test_heartbeats_of_one_process_share_one_connection_and_replace_a_gone_store(master_port):
    """Every Heartbeat of a process reuses one connection per store (each new connection costs a reverse DNS lookup on
    both ends); when that store is gone and another serves the same address, the next Heartbeat connects again."""
    port = master_port
    make = lambda: dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)  # noqa: E731
    server = make()
    first, second = (Heartbeat("127.0.0.1", port, rank=0, period=0.1) for _ in range(2))
    first.stop(), second.stop()
    assert first.store_connection is second.store_connection
    beats = lambda: dist.PrefixStore("pdist/heartbeat/", server).add("0", 0)  # noqa: E731
    assert beats() >= 2  # both beat into the job's store
    del server
    server = make()  # a new job on the same address: the old connection is dead
    third = Heartbeat("127.0.0.1", port, rank=0, period=0.1)
    third.stop()
    assert third.store_connection is not first.store_connection and beats() >= 1
