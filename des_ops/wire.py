"""Byte models of the collectives' wire traffic: the one place the ring formula is written.

    >>> payload_bytes = 4 * 4096 * 14          # float32 partials, 14 per sample, B = 4096
    >>> ring_share(4) * payload_bytes        # what each of 4 processes sends in a ring allreduce
    344064.0
"""
from __future__ import annotations

WIRE_DTYPES = ("float32", "float16")    # the types the partials may travel (and be summed) in



def ring_share(world_size: int) -> float:
    """What one process sends in a ring allreduce, per byte of payload: 2(N-1)/N (0 at N = 1).
    The one place this model of MPI's wire traffic is written."""
    return 2.0 * (world_size - 1) / world_size if world_size > 1 else 0.0
