"""A tiny random-weight Llama checkpoint, built locally (no downloads).

:func:`build_tiny_llama` writes a ``LlamaForCausalLM`` (head_dim 64 by default; the
CPU attention kernels need at least 32; optionally with sliding-window layers) and a byte-level BPE tokenizer trained
on a small synthetic corpus to a directory that vLLM can load with
``LLM(model=path)``. Weights are drawn with a fixed seed and a standard
deviation large enough that greedy decoding walks through many different
tokens instead of repeating one.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = ["build_tiny_llama", "PROMPTS", "VOCAB_SIZE", "token_prompts"]

VOCAB_SIZE = 512

PROMPTS = [
    "The elastic cache maps pages when requests arrive and",
    "Once upon a time a small scheduler",
    "Virtual memory lets a serving engine",
    "alpha beta gamma delta epsilon zeta eta theta",
]

def token_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 500,
                  prefix: list[int] | None = None) -> list[list[int]]:
    """``n`` prompts of ``lo``..``hi`` random token ids below ``vocab`` (after ``prefix``),
    the same for a seed: what the vLLM benchmarks send as ``prompt_token_ids``."""
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]


_WORDS = (
    "the a an cache page block memory request token engine map unmap virtual "
    "physical scheduler worker elastic grow shrink burst queue serve model layer "
    "head key value attention prefix hit miss evict free alloc once upon time small "
    "large fast slow alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"
).split()


def _corpus(n_lines: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(n_lines)]
    return lines + PROMPTS


def build_tiny_llama(
    path: str | os.PathLike[str],
    *,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    sliding_window: int | None = None,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    init_std: float = 0.3,
) -> Path:
    """Write a random-weight Llama and its tokenizer to ``path``; returns the path.

    Args:
        path: Output directory (created if missing).
        num_layers: Decoder layers.
        hidden_size: Model width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Width of one attention head (the CPU attention kernels need >= 32).
        sliding_window: When set, every other layer (the first, the third, ...) attends
            to this many tokens back (``layer_types``, as vLLM's Llama reads them): a
            model with sliding-window and full-attention layers.
        max_position_embeddings: Longest context the model accepts.
        seed: Seed for the weights and the tokenizer corpus.
        init_std: Standard deviation of the random weights.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim}: the CPU attention kernels need at least 32")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out)
    vocab = tok.get_vocab_size()

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        initializer_range=init_std,
    )
    if sliding_window is not None:
        config.sliding_window = sliding_window
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(num_layers)]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(0.0, init_std)
        # Never pick EOS greedily, so every request runs to max_tokens.
        model.lm_head.weight[fast.eos_token_id].fill_(-0.0)
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id,
           "pad_token_id": fast.pad_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


if __name__ == "__main__":  # pragma: no cover - manual use
    import sys

    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"))
