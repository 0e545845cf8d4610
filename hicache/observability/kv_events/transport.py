"""The ZMQ side of the publisher: which endpoints bind, the sockets, and the replay protocol."""

from __future__ import annotations

from collections.abc import Iterable

import zmq

from hicache.observability.kv_events.wire import END_SEQ


def binds(endpoint: str) -> bool:
    """vLLM's rule, so an endpoint string means what it means there: bind a wildcard host or
    port (`*`, `::`) and ipc/inproc endpoints; connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def open_sockets(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    replay_endpoint: str | None,
    *,
    hwm: int,
    linger: float,
    buffer_steps: int,
) -> tuple[zmq.Socket[bytes], str, zmq.Socket[bytes] | None, str | None]:
    """The PUB socket on `endpoint` and, with `replay_endpoint`, the ROUTER bound there, with
    the addresses actually bound: `(pub, endpoint, replay, replay_endpoint)`. Nothing stays
    open when this raises."""
    pub: zmq.Socket[bytes] | None = None
    replay: zmq.Socket[bytes] | None = None
    try:
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(hwm)
        pub.setsockopt(zmq.LINGER, int(linger * 1000))
        if binds(endpoint):
            pub.bind(endpoint)
            endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(endpoint)
        bound_replay: str | None = None
        if replay_endpoint is not None:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.SNDHWM, 2 * buffer_steps + 16)  # a whole replay fits
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(replay_endpoint)
            bound_replay = replay.getsockopt_string(zmq.LAST_ENDPOINT)
    except BaseException:
        close_sockets((pub, replay), linger=0)
        raise
    return pub, endpoint, replay, bound_replay


def close_sockets(sockets: Iterable[zmq.Socket[bytes] | None], *, linger: int | None) -> None:
    for sock in sockets:
        if sock is not None and not sock.closed:
            sock.close(linger=linger)


def answer_replay(replay: zmq.Socket[bytes], buffer: Iterable[tuple[int, bytes]]) -> bool | None:
    """Answer one waiting replay request from `buffer` (`(sequence, payload)` pairs): None when
    none waits, False when it was malformed (not answered), True when answered.

    A request is `[identity, b"", start]` from a REQ socket (as vLLM's) or `[identity, start]`
    from a DEALER that sends no delimiter; the answer keeps the request's envelope: one
    `(sequence, payload)` message per buffered batch from `start` on, then the end marker."""
    try:
        frames = replay.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None
    if len(frames) == 3 and frames[1] == b"":
        envelope, start = frames[:2], frames[2]
    elif len(frames) == 2:
        envelope, start = frames[:1], frames[1]
    else:
        return False
    first = int.from_bytes(start, "big")
    for seq, payload in list(buffer):
        if seq >= first:
            replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
    replay.send_multipart([*envelope, END_SEQ, b""])
    return True
