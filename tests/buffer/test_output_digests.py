"""Outputs are bitwise what they were before the backends seam: one fixed program of both modes'
calls (``output_digest_cases.py``), per rank, on every transport, hashed and compared with the
hashes the same program gave at commit 230de45 (before ``moe_comm.backends``), on the same
transports (they agreed there too)."""
import os

import pytest

from helpers.output_digest_cases import output_digest

SEED = 7
#: world size -> each rank's SHA-256 of its outputs at commit 230de45 (shm, collective and mpi alike)
RECORDED = {
    1: ["76cf5c5cf0618a07039ae38aa2ae451a9c35feaf0c777f029395c1ef875b45c6"],
    2: ["c580c43797a612b4b8d48ee1358ab04548a1a670c530d21f47a066ab8c7879ce",
        "fac0481f775ea34516a7f89db7632843cac085dfd1afc57075017cf230aad755"],
    3: ["ce499bd890af1d198baa197f250a180e5217339b37e5509e57dfe4f68f4a2df9",
        "5003a94855dabfff13ac756613424772a78d0f5b5b9b7721c108f09134a4671c",
        "76aeee296f7047fe6f3efbcfe438c9ece5c32f79cedd45da2ea8453a56dd4c9c"],
}


@pytest.mark.every_transport
@pytest.mark.parametrize("world_size", sorted(RECORDED))
def test_outputs_are_bitwise_those_of_the_commit_before_backends(worlds, world_size):
    assert worlds(world_size).run(output_digest, SEED) == RECORDED[world_size]


def _backend_of(group) -> tuple[str, str]:
    import moe_comm
    buf = moe_comm.Buffer(group)
    return buf.backend_choice.name, os.environ.get("MOE_COMM_BACKEND", "")


@pytest.mark.every_transport
def test_the_tests_run_on_the_backend_they_name(worlds, transport):
    """Every multi-rank test's Buffer (backend="auto" on gloo and mpi groups) is the portable backend,
    except in the cuda_host worlds, whose buffers (and so the digests above) are the CUDA kernels' host build."""
    expected = "cuda_host" if transport == "cuda_host" else "portable"
    assert {name for name, _ in worlds(2).run(_backend_of)} == {expected}
