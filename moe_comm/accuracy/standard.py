"""The accuracy standard every op of ``moe_comm.ops`` is held to, on every device and backend.

Two classes of output:

* **exact** -- pure data movement, indices and counts, and quantized codes and scales (every backend
  rounds the same way): same shape, dtype and bytes as the reference, bit for bit.
* **numeric** -- compared with an fp64 reference of the same math on the same inputs, by the output's
  precision (``STANDARD``). Named metrics, all in fp64:

  ``calc_diff``  DeepGEMM's ``1 - 2*sum(x*y) / sum(x*x + y*y)`` (about half the squared relative RMS error)
  ``max_abs``    max |out - ref|
  ``mare``       max relative error, ``|out - ref| / max(|ref|, floor)``, floor = ``small * rms(ref)``
  ``mere``       mean relative error, same denominator

  A check passes when calc_diff, mare and mere are all within the limits on the elements finite in both
  tensors, and the output's NaN, +Inf and -Inf are exactly the reference's (``check``'s non-finite
  policy: never a NaN or Inf where the reference is finite, never a vacuous pass). The floor plays the
  part of msprobe's small-value region: values near zero after cancellation in long sums are judged
  against a fraction of the tensor's RMS, not against themselves.

Limits (after the vendors' per-op accuracy standards): ``mere`` is the CANN op standard's T per dtype
(2^-13 fp32, 2^-10 fp16, 2^-7 bf16, 2^-3 e4m3, 2^-2 e5m2) and ``mare`` its 10*T. For FP8 and INT8,
where 10*T would exceed 1 and accept a zeroed or sign-flipped element, ``mare`` is 2^-1: that still
catches those, and admits what a correct kernel does, e.g. an FP8 intermediate code that rounds the
other way and moves a near-zero sum by a few steps (0.22 measured for the FP8 SwiGLU FFN on an H200).
``calc_diff`` follows DeepGEMM's FP8 GEMM limit (1e-3) for e4m3, DeepEP's low-latency combine limit
(1e-5) for bf16, and scales by the square of the mantissa step for the others.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

import torch

__all__ = ["Tolerance", "STANDARD", "EXACT", "Report", "AccuracyError", "calc_diff", "metrics", "check"]

EXACT = "exact"


@dataclass(frozen=True)
class Tolerance:
    """Limits for one output precision; ``small`` sets the relative-error floor (``small * rms(ref)``)."""

    calc_diff: float
    mere: float
    mare: float
    small: float


STANDARD: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(calc_diff=1e-10, mere=2.0 ** -13, mare=10 * 2.0 ** -13, small=2.0 ** -10),
    torch.float16: Tolerance(calc_diff=1e-6, mere=2.0 ** -10, mare=10 * 2.0 ** -10, small=2.0 ** -5),
    torch.bfloat16: Tolerance(calc_diff=1e-5, mere=2.0 ** -7, mare=10 * 2.0 ** -7, small=2.0 ** -5),
    torch.float8_e4m3fn: Tolerance(calc_diff=1e-3, mere=2.0 ** -3, mare=2.0 ** -1, small=2.0 ** -2),
    torch.float8_e5m2: Tolerance(calc_diff=4e-3, mere=2.0 ** -2, mare=2.0 ** -1, small=2.0 ** -2),
    # Per-token int8: half a code step is amax / 254, about 1/60 of the row's RMS for normal data.
    torch.int8: Tolerance(calc_diff=1e-4, mere=2.0 ** -5, mare=2.0 ** -2, small=2.0 ** -2),
}


class AccuracyError(AssertionError):
    """An output failed the standard; the message names the op, the metric, its value and the limit."""


@dataclass
class Report:
    """One check: what was compared, the measured metrics and the verdict."""

    op: str
    standard: str                    # "exact" or the dtype name whose limits applied
    passed: bool
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str = ""                 # why it failed; on a pass, what went uncompared ("" when nothing did)

    def raise_if_failed(self) -> "Report":
        if not self.passed:
            raise AccuracyError(f"{self.op}: {self.reason}")
        return self


def calc_diff(out: torch.Tensor, ref: torch.Tensor, shift: float = 0.0) -> float:
    """DeepGEMM's dissimilarity in fp64: 0 for identical tensors (and for two all-zero tensors). DeepEP's
    tests use ``shift=1`` (add 1 to both first, which tames data near zero)."""
    x, y = out.double() + shift, ref.double() + shift
    denominator = float((x * x + y * y).sum())
    return 0.0 if denominator == 0.0 else float(1 - 2 * (x * y).sum() / denominator)


def _kind(x: torch.Tensor) -> torch.Tensor:
    """Per element of ``x``: 0 finite, 1 NaN, 2 +Inf, 3 -Inf (int8, same shape)."""
    kind = torch.zeros(x.shape, dtype=torch.int8)
    kind[torch.isnan(x)] = 1
    kind[torch.isposinf(x)] = 2
    kind[torch.isneginf(x)] = 3
    return kind


# The metrics that count elements whose NaN/+Inf/-Inf differs from the reference's, as check names them.
_NONFINITE_MISMATCHES = {
    "nonfinite": "NaN/Inf elements where the reference is finite",
    "missing_nonfinite": "finite elements where the reference is NaN/Inf",
    "wrong_nonfinite": "NaN/Inf elements where the reference has the other one (NaN vs Inf, or the other sign)",
}


def metrics(out: torch.Tensor, ref: torch.Tensor, small: float) -> dict[str, float]:
    """calc_diff, max_abs, mare, mere (see the module docstring) over the elements finite in both tensors;
    ``finite_compared``: how many those are; and the elements of ``out`` whose NaN/+Inf/-Inf differs from
    ``ref``'s: ``nonfinite`` NaN/Inf where ``ref`` is finite, ``missing_nonfinite`` finite where ``ref``
    is NaN/Inf, ``wrong_nonfinite`` NaN where ``ref`` is Inf, Inf where it is NaN or the opposite Inf."""
    out64, ref64 = out.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    out_kind, ref_kind = _kind(out64), _kind(ref64)
    both_finite = (out_kind == 0) & (ref_kind == 0)
    differ = out_kind != ref_kind
    counts = {"finite_compared": float(both_finite.sum()),
              "nonfinite": float((differ & (ref_kind == 0)).sum()),
              "missing_nonfinite": float((differ & (out_kind == 0)).sum()),
              "wrong_nonfinite": float((differ & (out_kind != 0) & (ref_kind != 0)).sum())}
    out64, ref64 = out64[both_finite], ref64[both_finite]
    if ref64.numel() == 0:
        return {"calc_diff": 0.0, "max_abs": 0.0, "mare": 0.0, "mere": 0.0, **counts}
    error = (out64 - ref64).abs()
    rms = math.sqrt(float((ref64 * ref64).mean()))
    floor = max(small * rms, torch.finfo(torch.float64).tiny)
    relative = error / ref64.abs().clamp_min(floor)
    return {"calc_diff": calc_diff(out64, ref64), "max_abs": float(error.max()), "mare": float(relative.max()),
            "mere": float(relative.mean()), **counts}


def _exact(op: str, out: torch.Tensor, ref: torch.Tensor) -> Report:
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return Report(op, EXACT, False, reason=f"expected {ref.dtype} {list(ref.shape)}, got {out.dtype} "
                                                   f"{list(out.shape)}")
    a, b = out.detach().cpu().contiguous(), ref.detach().cpu().contiguous()
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)
    bytes_a, bytes_b = a.view(torch.uint8).reshape(-1), b.view(torch.uint8).reshape(-1)
    mismatched = int((bytes_a != bytes_b).sum())
    if mismatched:
        return Report(op, EXACT, False, {"mismatched_bytes": float(mismatched)},
                      reason=f"{mismatched} of {bytes_a.numel()} bytes differ from the reference")
    return Report(op, EXACT, True, {"mismatched_bytes": 0.0})


def check(op: str, out: torch.Tensor, ref: torch.Tensor, dtype: Union[torch.dtype, str] = EXACT,
          raise_on_fail: bool = True) -> Report:
    """Checks ``out`` against ``ref`` by the standard: ``dtype=EXACT`` compares bytes (NaNs too, payload
    and all); a torch dtype (the precision the op's result was rounded to) applies ``STANDARD[dtype]``
    against an fp64 ``ref``. Raises AccuracyError on failure unless ``raise_on_fail`` is False; returns
    the Report.

    Non-finite policy of a numeric check: ``out`` must have a NaN exactly where ``ref`` has one, +Inf
    exactly where ``ref`` has +Inf and -Inf exactly where it has -Inf. Any element where that does not
    hold fails the check, whatever the other metrics say (``metrics`` counts the three ways: NaN/Inf
    where ``ref`` is finite, finite where it is not, the other NaN/Inf). The limits then apply to the
    elements finite in both. A reference with no finite value is held to the same rule, so it passes
    only when ``out`` has its NaN/Inf pattern exactly, never vacuously; the report's ``reason`` then
    says that no finite values were compared.
    """
    if dtype == EXACT:
        report = _exact(op, out, ref)
    else:
        if dtype not in STANDARD:
            raise ValueError(f"check: dtype must be {EXACT!r} or one of {[str(d) for d in STANDARD]}, got {dtype!r}")
        if out.shape != ref.shape:
            report = Report(op, str(dtype), False, reason=f"shape {list(out.shape)} != reference {list(ref.shape)}")
        else:
            limits = STANDARD[dtype]
            found = metrics(out, ref, limits.small)
            failed = [f"{int(found[name])} {what}" for name, what in _NONFINITE_MISMATCHES.items() if found[name]]
            failed += [f"{name} {found[name]:.3g} > {limit:.3g}" for name, limit in
                       (("calc_diff", limits.calc_diff), ("mere", limits.mere), ("mare", limits.mare))
                       if not found[name] <= limit]
            notes = failed + (["no finite values compared"] if found["finite_compared"] == 0 else [])
            report = Report(op, str(dtype).replace("torch.", ""), not failed, found, "; ".join(notes))
    return report.raise_if_failed() if raise_on_fail else report

