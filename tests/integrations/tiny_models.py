"""The tiny random Llama the integration tests run through transformers (two layers,
four query heads over two KV heads: GQA), seeded so that every test gets the same one."""

import torch


def tiny_llama(*, vocab_size: int, hidden_size: int, intermediate_size: int, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=intermediate_size,
                      max_position_embeddings=max_positions)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()
