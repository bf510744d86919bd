"""Small random Hugging Face models for the module, checkpoint and recipe tests (no hub access).

GPT-2 (Conv1D layers, tied ``lm_head``/``wte``, biases) and Llama (Linear layers, GQA,
rotary buffers, untied head), 2 layers, float64, dropout off.
"""

import torch

VOCAB, SEQ = 64, 8


def gpt2(seed: int = 0, n_layer: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=n_layer, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).double()


def llama(seed: int = 0, n_layer: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=n_layer,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return LlamaForCausalLM(cfg).double()


MODELS = {"gpt2": gpt2, "llama": llama}
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers"}


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(1000 + step)
    tok = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return tok, torch.roll(tok, -1, dims=1)
