"""A tiny random-weight LLaVA (56 px CLIP vision tower + 2-layer Llama) for vLLM tests on CPU.

Everything is built locally: a word-level tokenizer trained with ``tokenizers`` (with
an ``<image>`` token), a CLIP image processor, the configs and random weights. No
network access is needed (set ``HF_HUB_OFFLINE=1``). vLLM loads the directory like
any Hugging Face checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 56
PATCH_SIZE = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # "default" strategy drops CLS
_WORDS = (
    "the a an of to in is it on for with as at by this that what which who where when why how "
    "image picture photo describe tell me about show see color red green blue cat dog car tree "
    "house sky sun moon water big small one two three four five yes no user assistant please"
).split()


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    corpus = [" ".join(_WORDS)] + [f"w{i}" for i in range(vocab_size)]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=specials))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=[IMAGE_TOKEN],
    )
    return fast


def build_tiny_llava(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny random LLaVA checkpoint (config, weights, tokenizer, processor) to ``out_dir``."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_size=512)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vocab = len(tokenizer)

    vision = CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        projection_dim=64,
    )
    text = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=NUM_IMAGE_TOKENS,
    )
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # large random weights so greedy output varies by input
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    _rename_vision_tower_keys(out, load_file, save_file)

    tokenizer.save_pretrained(out)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    processor.save_pretrained(out)
    return out


def _rename_vision_tower_keys(out: Path, load_file, save_file) -> None:
    """transformers 5 writes ``...vision_tower.<x>``; vLLM's LLaVA expects ``...vision_tower.vision_model.<x>``."""
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(path))
        renamed = {}
        for name, tensor in tensors.items():
            head, sep, tail = name.partition("vision_tower.")
            if sep and not tail.startswith("vision_model."):
                name = f"{head}vision_tower.vision_model.{tail}"
            renamed[name] = tensor.contiguous()
        save_file(renamed, str(path), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        mapping = {}
        for name, file in data["weight_map"].items():
            head, sep, tail = name.partition("vision_tower.")
            if sep and not tail.startswith("vision_model."):
                name = f"{head}vision_tower.vision_model.{tail}"
            mapping[name] = file
        data["weight_map"] = mapping
        index.write_text(json.dumps(data, indent=2))


def make_image(seed: int = 0, size: int = IMAGE_SIZE):
    """A deterministic RGB PIL image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8), "RGB")


def llava_prompt(question: str = "describe the image") -> str:
    return f"user {IMAGE_TOKEN} {question} assistant"
