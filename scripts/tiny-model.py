"""A tiny random-weight Llama and a byte-level BPE tokenizer trained here,
for a real vLLM in the tests (no model hub is reachable): 426,624
parameters, under 1 MB. What it says is noise; what the tests check is the
server's protocol. head_dim 32: vLLM's CPU attention supports it.

Usage: python tiny-model.py OUT_DIR
"""
import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
import torch

out = sys.argv[1]
random.seed(7)
torch.manual_seed(7)
words = "the a model sleeps wakes loads serves gpu memory request token answer router node pod".split()
sentences = [" ".join(random.choice(words) for _ in range(random.randint(4, 12))) for _ in range(2000)]

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(
    sentences,
    trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
fast.chat_template = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
fast.save_pretrained(out)

config = LlamaConfig(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
    bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
    torch_dtype="bfloat16",
)
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
print(f"{out}: {sum(p.numel() for p in model.parameters())} parameters")
