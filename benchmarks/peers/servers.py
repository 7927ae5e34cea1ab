"""The servers of the sweep, in the order of its first round (the next round runs them reversed)."""

from __future__ import annotations

from benchmarks.peers import (
    batchserve_mlp,
    bentoml_mlp,
    litserve_mlp,
    mlserver_mlp,
    mosec_mlp,
    rayserve_mlp,
    triton_mlp,
)
from benchmarks.peers.peer import Peer

PEERS: dict[str, Peer] = {
    m.PEER.name: m.PEER
    for m in (batchserve_mlp, mosec_mlp, triton_mlp, bentoml_mlp, litserve_mlp, rayserve_mlp,
              mlserver_mlp)
}
