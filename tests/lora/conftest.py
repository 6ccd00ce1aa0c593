"""PEFT adapters on the tiny Llama, saved as PEFT saves them (random lora_B too, so every adapter changes the
output), and the HF + peft oracle that generates under one of them."""
from __future__ import annotations

import pytest
import torch

# name -> (peft LoraConfig keywords); together they cover every projection, rsLoRA, alpha != r and ranks 4..16.
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]),
    "qv_rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=16, lora_alpha=16, target_modules=["o_proj", "gate_proj", "down_proj"]),
}


def make_adapter(base_dir: str, out_dir: str, seed: int, safe: bool = True, **kw) -> str:
    import peft
    import transformers as tf
    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(lora_dropout=0.0, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir, safe_serialization=safe)
    return out_dir


@pytest.fixture(scope="session")
def lora_base(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def lora_adapters(lora_base, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(lora_base, str(root / name), seed=i + 1, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="session")
def peft_greedy(lora_base):
    """(adapter dir or None, prompt token ids, n) -> HF's greedy tokens under that adapter (fp32, CPU)."""
    import peft
    import transformers as tf
    models = {}

    def run(adapter: str | None, ids: list[int], n: int) -> list[int]:
        if adapter not in models:
            hf = tf.AutoModelForCausalLM.from_pretrained(lora_base, dtype=torch.float32).eval()
            models[adapter] = peft.PeftModel.from_pretrained(hf, adapter).eval() if adapter else hf
        x = torch.tensor([ids])
        with torch.no_grad():
            out = models[adapter].generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                           do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[0, len(ids):].tolist()
    return run
