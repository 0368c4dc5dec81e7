"""Hugging Face folders of a fine-tuned causal language model (export.format=peft and hf_merged).

    export.format  folder         holds                                    loads with
    peft           <run>/adapter  the adapters (adapter_config.json,       PeftModel.from_pretrained(base,
                                  adapter_model.safetensors), tokenizer     folder) on the base model
    hf_merged      <run>/merged   the base with the adapters merged in:     AutoModelForCausalLM.from_pretrained
                                  config, safetensors, tokenizer            (folder) alone, and generates

They need a LightningModule holding a PEFT model (`peft.PeftModel`, e.g. model=causal_lm_lora); the
tokenizer's files are copied from the data's `tokenizer` folder. Each export is loaded back as a user
loads it (transformers and peft alone, no template code) and its logits compared with the checkpoint
model's; a merged one also generates a few tokens.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctrain.runtime.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

    from hpctrain.runtime.inference.loaded import Predictor

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)


def peft_model(predictor: Predictor, name: str) -> Any:
    """The PEFT model inside the checkpoint's LightningModule."""
    from peft import PeftModel

    found = next((m for m in predictor.model.modules() if isinstance(m, PeftModel)), None)
    if found is None:
        raise UserError(
            f"export.format={name} writes a PEFT model's folder, but {type(predictor.model).__name__} holds none "
            "(no peft.PeftModel inside); export it with export.format=torch_export, onnx or safetensors."
        )
    return found


def _save_folder(model: Any, predictor: Predictor, folder: Path) -> None:
    """`model.save_pretrained` into `folder`, with the data config's tokenizer files beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    source = (predictor.config.get("data") or {}).get("tokenizer")
    if not source:
        return
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, folder / name)


def _dequantized(predictor: Predictor) -> int:
    """A base trained quantized (QLoRA) back in the values it computed with: the layers it had quantized."""
    dequantize = getattr(predictor.model, "dequantize", None)
    return dequantize() if callable(dequantize) else 0


def write_peft(predictor: Predictor, example: Tensor, path: Path) -> None:
    if quantized := _dequantized(predictor):
        raise UserError(
            f"export.format=peft writes adapters for the base in its folder, but they were trained over its "
            f"quantized weights ({quantized} layers in 4 bits); export.format=hf_merged writes them merged into "
            "those weights, as the model computed."
        )
    _save_folder(peft_model(predictor, "peft"), predictor, path)


def write_merged(predictor: Predictor, example: Tensor, path: Path) -> None:
    _dequantized(predictor)
    merged = copy.deepcopy(peft_model(predictor, "hf_merged")).merge_and_unload()
    merged.config.use_cache = True  # for generation, the user's next step
    _save_folder(merged, predictor, path)


def run_peft(path: Path, inputs: Tensor, predictor: Predictor) -> Any:
    """As a user loads it: the base from its folder (as the adapter's config names it), the adapters on it."""
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    base = PeftConfig.from_pretrained(str(path)).base_model_name_or_path
    loaded = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=False)  # never a folder's own code
    model = PeftModel.from_pretrained(loaded, str(path)).eval()
    with torch.no_grad():
        return model(input_ids=inputs).logits


def run_merged(path: Path, inputs: Tensor, predictor: Predictor) -> Any:
    """As a user loads it: transformers alone; it must also generate."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=False).eval()
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
        model.generate(input_ids=inputs[:1], max_new_tokens=4, do_sample=False)
    return logits


def peft_card(exported: Any, predictor: Predictor) -> list[str]:
    return [
        "from peft import PeftConfig, PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"base = PeftConfig.from_pretrained({exported.path.name!r}).base_model_name_or_path  # the base folder",
        f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), {exported.path.name!r})",
        *_chat(exported.path.name),
    ]


def merged_card(exported: Any, predictor: Predictor) -> list[str]:
    return [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"model = AutoModelForCausalLM.from_pretrained({exported.path.name!r})",
        *_chat(exported.path.name),
    ]


def _chat(folder: str) -> list[str]:
    """The card's lines that load the exported folder's tokenizer and answer one chat prompt."""
    return [
        f"tokenizer = AutoTokenizer.from_pretrained({folder!r})",
        'prompt = tokenizer.apply_chat_template([{"role": "user", "content": "..."}], add_generation_prompt=True,'
        ' return_tensors="pt", return_dict=True)',
        "answer = model.generate(**prompt, max_new_tokens=64)",
    ]
