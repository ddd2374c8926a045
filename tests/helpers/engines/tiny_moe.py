"""A small random Qwen3-MoE model (an architecture vLLM and SGLang both serve), made offline from a
fixed seed: 2 layers, 8 experts, top-2, BF16, with a word-level tokenizer over its vocabulary.
``save(path, hidden)`` writes it with ``save_pretrained``; nothing is downloaded."""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
EXPERTS = 8
TOP_K = 2
LAYERS = 2
SEED = 7
ROUTER_STD = 1.0


def config(hidden: int, experts: int = EXPERTS):
    """The model's ``Qwen3MoeConfig`` for ``hidden`` (attention: 4 heads of 64 channels whatever the hidden size)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                          moe_intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, num_experts=experts, num_experts_per_tok=TOP_K,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          max_position_embeddings=256, tie_word_embeddings=False, torch_dtype="bfloat16",
                          bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _tokenizer(path: Path) -> None:
    """A word-level tokenizer: ids 0-3 are the special tokens, token ``t<i>`` is id i for every other id, so a
    prompt of ordinary ids round-trips as text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, VOCAB)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(str(path))


def save(path: Path, hidden: int, experts: int = EXPERTS) -> Path:
    """Writes the model with hidden size ``hidden`` (weights from ``SEED``) and its tokenizer to ``path``."""
    from transformers import Qwen3MoeForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = Qwen3MoeForCausalLM(config(hidden, experts)).to(torch.bfloat16)
    with torch.no_grad():  # larger than the default init so that the experts shape the logits and the
        for name, p in model.named_parameters():  # router's choices are clear-cut
            if p.dim() >= 2:
                p.normal_(0, ROUTER_STD if name.endswith("mlp.gate.weight") else 0.08)
    model.save_pretrained(str(path))
    _tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


def margins(path: Path, sequences: list[list[int]]) -> tuple[float, float]:
    """Over every token of ``sequences``, computed by ``transformers`` in fp32: the smallest gap, over every layer,
    between the 2nd and 3rd largest router logits (what decides the top-2: a near-tie could route one token to
    other experts under a different summation order), and the largest output logit's magnitude (what sets the
    bf16 rounding step of the logits)."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    smallest, largest = float("inf"), 0.0
    with torch.no_grad():
        for ids in sequences:
            out = model(torch.tensor([ids]), output_router_logits=True)
            largest = max(largest, float(out.logits.abs().max()))
            for logits in out.router_logits:
                top = logits.float().reshape(logits.shape[0], -1).topk(TOP_K + 1, dim=-1).values
                smallest = min(smallest, float((top[:, TOP_K - 1] - top[:, TOP_K]).min()))
    return smallest, largest
