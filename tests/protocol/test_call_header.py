"""The native verdict on one call's headers (``protocol.call_header.agree``, ``csrc/common/call_header.h``,
which the CUDA kernels' receive runs too) against the Python verdict (``handshake.check`` through
``CallAgreement.judge``'s checks): agreeing headers give the rows sent to this rank; every kind of
difference gives None (the caller then judges in Python). Single process."""
import pytest
import torch

from moe_comm.core.native import native
from moe_comm.protocol.call_header import agree, decode, encode
from moe_comm.protocol.codes import UNKNOWN, Field, Op
from moe_comm.protocol.handshake import Handshake, check, vector

R = 3
WIDTH = len(Field) + 4 * R
COMPARE = (Field.HIDDEN, Field.NUM_EXPERTS)
MASK = sum(1 << int(f) for f in (Field.OP, Field.CALL) + COMPARE)


def _headers(**change) -> torch.Tensor:
    """Rank r sends (r + 1) * (d + 1) rows to rank d and expects what each sends; digests alike."""
    rows = []
    for r in range(R):
        fields = {Field.OP: Op.LOW_LATENCY_COMBINE, Field.CALL: 5, Field.REJECTED: 0, Field.HIDDEN: 256,
                  Field.NUM_EXPERTS: 12}
        sent = [(r + 1) * (d + 1) for d in range(R)]
        expected = [(s + 1) * (r + 1) for s in range(R)]
        digests_sent = [100 * r + d for d in range(R)]
        digests_expected = [100 * s + r for s in range(R)]
        row = vector(fields, sent, expected, digests_sent, digests_expected, R)
        rows.append(row)
    for (rank, word), value in change.get("words", {}).items():
        rows[rank][word] = value
    return torch.stack([encode(row, None) for row in rows])


def _python_agrees(headers: torch.Tensor) -> bool:
    shake = Handshake(decode(headers, WIDTH))
    if len(set(shake.field(Field.CALL))) > 1 or any(shake.field(Field.REJECTED)):
        return False
    try:
        check(shake, "op", COMPARE)
    except Exception:
        return False
    return True


def test_agreeing_headers_give_the_rows_sent_to_this_rank():
    headers = _headers()
    assert _python_agrees(headers)
    for me in range(R):
        assert agree(headers, WIDTH, len(Field), me, MASK, int(Field.REJECTED)) == [(s + 1) * (me + 1)
                                                                                    for s in range(R)]


F = len(Field)


@pytest.mark.parametrize("name,words", [
    ("hidden", {(2, int(Field.HIDDEN)): 128}),
    ("call", {(1, int(Field.CALL)): 6}),
    ("op", {(0, int(Field.OP)): int(Op.LOW_LATENCY_DISPATCH)}),
    ("rejected", {(1, int(Field.REJECTED)): 1}),
    ("rows", {(0, F + 2): 99}),                   # rank 0 sends rank 2 other rows than rank 2 expects
    ("digest", {(1, F + 2 * R + 0): 7}),          # rank 1's digest of the rows to rank 0
])
def test_each_difference_is_found_as_python_finds_it(name, words):
    headers = _headers(words=words)
    assert not _python_agrees(headers)
    assert agree(headers, WIDTH, F, 0, MASK, int(Field.REJECTED)) is None


def test_unknown_expectations_are_not_compared():
    headers = _headers(words={(2, F + R + 0): UNKNOWN, (2, F + 3 * R + 1): UNKNOWN})
    assert _python_agrees(headers)
    assert agree(headers, WIDTH, F, 1, MASK, int(Field.REJECTED)) == [2, 4, 6]


def test_the_native_check_refuses_headers_too_small_for_its_reads():
    headers = _headers()
    with pytest.raises(ValueError, match="headers_agree: .* at least 8 \\* max"):
        native().headers_agree(headers.data_ptr(), 256, R, 0, F, int(Field.REJECTED), MASK)
    with pytest.raises(ValueError, match="me in \\[0, num_ranks\\)"):
        native().headers_agree(headers.data_ptr(), headers.shape[1], R, R, F, int(Field.REJECTED), MASK)
