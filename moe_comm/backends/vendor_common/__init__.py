"""What the backends built on a chip vendor's fused MoE operators (``ascend``: MC2; ``cambricon``:
torch_mlu_ops) share: the guarded import and refusals (``backend``), per-dispatch state kept by the
handle (``per_handle``) and the bounds-checked expert-grouped row copy (``expert_rows``)."""
