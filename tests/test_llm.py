"""Fine-tuning a language model (docs/guides/fine-tune-a-language-model.md): a Hugging Face causal LM with
LoRA adapters under FSDP2 on CPU (2 processes, gloo), on the tiny base experiment=lora_sft makes offline.

One session fixture makes the base and the instructions; one trained run (`lora_run`, 8 steps of
experiment=lora_sft under trainer=fsdp_cpu) is read by several tests: what trains and what stays as it
was, what the checkpoints hold, generation as the first call after sharding with ranks stopping apart,
tokens/s. The resume, the exports and DDP run from it. In-process tests cover the labels, packing, the
fingerprint of a frozen base, FSDP2's grouping of tied and mixed-dtype parameters, and tokenizing once.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import sharded, trainable_only
from tests.helpers import (
    ROOT,
    assert_ok,
    read_metrics,
    require_modules,
    run_dirs,
    run_entry,
    run_script,
    train,
)

SHORT = (
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=2",
)


def require_llm() -> None:
    require_modules("transformers", "peft", "tokenizers", "safetensors", install="pip install -e '.[llm]'")


class Run(NamedTuple):
    dir: Path
    stdout: str
    logs: Path
    seconds: float


@pytest.fixture(scope="session")
def llm_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir holding tiny_llm/: the demo's base folder and instructions, made as experiment=lora_sft
    makes them (offline)."""
    require_llm()
    from myproject.data import tiny_llm

    data = tmp_path_factory.mktemp("llm_data")
    tiny_llm.make(data / "tiny_llm")
    return data


@pytest.fixture(scope="session")
def lora_run(llm_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """experiment=lora_sft for 8 steps: a short collective timeout; the first call to the sharded model a
    generation (ranks stopping apart); at step 3 a checkpoint as stored and one with everything, and
    one with everything at the end."""
    logs = tmp_path_factory.mktemp("lora_run")
    started = time.monotonic()
    result = train(
        logs,
        "experiment=lora_sft",
        f"paths.data_dir={llm_data}",
        *SHORT,
        "dist.timeout_min=0.5",
        "dist.init_timeout_min=3",  # until the first step: rank 1's interpreter starts in it
        "callbacks.performance.peak_flops=1e12",  # a peak, as a GPU's is known: the MFU is reported
        "+callbacks.first_call._target_=tests.llm_code.GenerateAtStart",
        f"+callbacks.first_call.dir={logs / 'generated'}",
        "+callbacks.both._target_=tests.llm_code.SaveBothAtStep",
        "+callbacks.both.step=3",
        f"+callbacks.both.path={logs / 'mid.ckpt'}",
        f"+callbacks.both.full_path={logs / 'full.ckpt'}",
        f"+callbacks.both.full_at_end={logs / 'end_full.ckpt'}",
        env={"PYTHONPATH": str(ROOT)},
        timeout=400,
    )
    assert_ok(result)
    (run,) = run_dirs(logs)
    return Run(run, result.stdout, logs, time.monotonic() - started)


def _keys(folder: Path) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def _base_tensors(llm_data: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(llm_data / "tiny_llm" / "base" / "model.safetensors"))


def _file_key(name: str) -> str:
    return name.removeprefix("net.base_model.model.").replace(".base_layer.", ".")


# ------------------------------------------------------------------------------------------ the trained run


@pytest.mark.slow
def test_only_the_adapters_train_and_the_base_stays_bit_identical(lora_run: Run, llm_data: Path):
    """The optimizer holds state for the LoRA parameters alone; after training the whole model (saved with
    everything) holds the base's tensors bit for bit, and every LoRA B matrix (zero at the start) moved."""
    last = lora_run.dir / "checkpoints" / "last.ckpt"
    optimizer_keys = [k for k in _keys(last) if k.startswith("optimizer_0.state.")]
    assert optimizer_keys and all(".lora_A." in k or ".lora_B." in k for k in optimizer_keys)
    assert "checkpoints: the trainable parameters only" in lora_run.stdout

    whole = sharded.read_folder(lora_run.logs / "end_full.ckpt")["state_dict"]
    base = _base_tensors(llm_data)
    frozen = {k: v for k, v in whole.items() if "lora_" not in k}
    # the demo base ties its output layer to the embedding, as most bases do: its file stores it once
    head, embedding = "net.base_model.model.lm_head.weight", "net.base_model.model.model.embed_tokens.weight"
    assert "lm_head.weight" not in base and len(frozen) == len(base) + 1
    assert torch.equal(frozen.pop(head), frozen[embedding])
    assert all(torch.equal(v, base[_file_key(k)]) for k, v in frozen.items())

    trained = sharded.read_folder(last)["state_dict"]
    b_matrices = {k: v for k, v in trained.items() if ".lora_B." in k}
    assert len(b_matrices) == 2 * 2  # 2 layers x (q_proj, v_proj)
    assert all(v.abs().sum() > 0 for v in b_matrices.values())


@pytest.mark.slow
def test_a_trainable_only_checkpoint_holds_no_base_and_is_under_a_fifth_of_a_whole_one(lora_run: Run):
    mid, full = lora_run.logs / "mid.ckpt", lora_run.logs / "full.ckpt"
    weights = [k.removeprefix("state_dict.") for k in _keys(mid) if k.startswith("state_dict.")]
    assert weights and all("lora_" in k for k in weights)
    assert any("base_layer" in k for k in _keys(full))  # the same step saved whole holds the base
    assert _size(mid) * 5 < _size(full), (_size(mid), _size(full))
    stored = trainable_only.stored(torch.load(mid / sharded.META_FILE, weights_only=True))
    assert stored is not None and len(stored["names"]) == 20 and stored["digest"]  # the tied head once


@pytest.mark.slow
def test_generation_is_the_first_call_after_sharding_and_ranks_stop_apart(lora_run: Run):
    """Rank 0 stopped after 3 new tokens, rank 1 after 7, within dist.init_timeout_min=3 (no rank waited
    for another into it); a chat sample after the validation, each rank with its own draws, within
    dist.timeout_min=0.5."""
    generated = lora_run.logs / "generated"
    assert [(generated / f"generated-{r}.txt").read_text() for r in (0, 1)] == ["3", "7"]
    assert "sample after epoch 0: Reverse the word kalo. ->" in lora_run.stdout


@pytest.mark.slow
def test_tokens_per_second_and_the_learning_rate_are_logged_per_log_interval(lora_run: Run):
    """8 steps logged every 2: tokens/s and the (cosine) learning rate at each logging step, so a warmup
    or a slowdown shows; the MFU and the sharding in the summary."""
    rows = read_metrics(lora_run.dir)
    tokens = {int(r["step"]): float(r["train/tokens_per_s"]) for r in rows if r.get("train/tokens_per_s")}
    rates = {int(r["step"]): float(r["lr-AdamW"]) for r in rows if r.get("lr-AdamW")}
    assert sorted(tokens) == [1, 3, 5, 7] and all(v > 0 for v in tokens.values())
    assert sorted(rates) == [1, 3, 5, 7] and rates[1] > rates[3] > rates[5] > rates[7]
    assert re.search(r"performance: .* TFLOP/s per device, MFU \d", lora_run.stdout)  # FLOPs from the shape
    assert "FSDP2: 2 block(s) sharded over 2 process(es) (LlamaDecoderLayer)" in lora_run.stdout
    assert "pretrained base: 20 tensors read into their shards" in lora_run.stdout


@pytest.mark.slow
def test_a_run_resumed_mid_epoch_ends_as_the_uninterrupted_one(lora_run: Run, llm_data: Path, tmp_path: Path):
    """From the step-3 checkpoint (adapters only), in a new job whose data and base are staged to
    node-local disk and whose checkpoints are written asynchronously: the base is read again from its
    folder, nothing is tokenized again, and the final adapters and optimizer state are bit-equal to the
    uninterrupted run's."""
    stage = tmp_path / "stage"
    result = train(
        tmp_path,
        "experiment=lora_sft",
        f"paths.data_dir={llm_data}",
        *SHORT,
        f"ckpt_path={lora_run.logs / 'mid.ckpt'}",
        f"data.stage_dir={stage}",
        f"model.base.stage_dir={stage}",
        "checkpoints.async_save=true",  # its folders written while training goes on
        timeout=400,
    )
    assert_ok(result)
    # tokenized once, by whichever run of the session came first: this one read those shards
    assert (
        "tokenized " not in result.stdout and len(list((llm_data / "tokenized").glob("instructions-*"))) == 1
    )
    # the shards and the base copied to node-local disk, each by one rank while the other waited
    assert len(list(stage.glob("hpctrain-*/instructions-*/.staged.json"))) == 1
    assert len(list(stage.glob("hpctrain-*/base/.staged.json"))) == 1
    assert result.stdout.count(f"staging {llm_data / 'tiny_llm' / 'base'} ") == 1
    (resumed,) = run_dirs(tmp_path)
    a, b = (_everything(r / "checkpoints" / "last.ckpt", tmp_path / r.name) for r in (lora_run.dir, resumed))
    assert any(k.startswith("optimizer_0.state.") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _everything(folder: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint (the weights and the optimizer state), by dotted key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(scratch.with_suffix(".pt")))
    return json_free(torch.load(scratch.with_suffix(".pt"), weights_only=True))


@pytest.mark.slow
def test_the_guides_lines_run_in_order(lora_run: Run, llm_data: Path, tmp_path: Path):
    """The guide's first block, line by line, each with the tests' short limits (its second line is the
    session's lora_run): the base validated before fine-tuning; a DDP run; `ckpt_path=last` continuing the
    DDP run's file checkpoint under FSDP2 for two more epochs; eval on the val split; answers to a JSONL of
    prompts (under FSDP2); an export. `<run>` is the newest run's folder."""
    from tests.test_docs import block_commands, blocks

    guide = ROOT / "docs" / "guides" / "fine-tune-a-language-model.md"
    lines = block_commands(blocks(guide)[0])
    second = ["python", "src/train.py", "experiment=lora_sft"]
    assert shlex.split(lines[1], comments=True) == second  # the session's lora_run
    logs, outputs, newest = lora_run.logs, [], {"train": lora_run.dir}
    quick = (*SHORT, "trainer.limit_train_batches=4", f"paths.data_dir={llm_data}", "dist.timeout_min=0.5")
    for line in [lines[0], *lines[2:]]:
        words = shlex.split(line, comments=True)
        if words[0] != "python":  # writing the prompts
            assert subprocess.run(line, shell=True, cwd=tmp_path).returncode == 0, line
            continue
        task = {"src/train.py": "train", "src/eval.py": "eval", "src/predict.py": "predict"}.get(words[1])
        args = [w.replace("<run>", str(newest["train"])) for w in words[2:]]
        args = [a.replace("=prompts.jsonl", f"={tmp_path / 'prompts.jsonl'}") for a in args]
        if task == "train":
            result = train(logs, *quick, *args, timeout=400)  # the line's own values last: they win
        else:
            where = [f"paths.log_dir={logs}", f"paths.data_dir={llm_data}"]
            if task == "predict":  # answered under FSDP2: generate gathers the sharded root at each step
                where += ["trainer=fsdp_cpu", "dist.timeout_min=0.5"]
            result = run_entry(words[1].removeprefix("src/"), *args, *where, timeout=400)
        assert_ok(result)
        outputs.append(result.stdout)
        if task:
            newest[task] = max(run_dirs(logs, task), key=lambda r: r.name)
        if "trainer=ddp_cpu" in line:
            ddp_run = newest["train"]

    validated, _, continued, evaluated, predicted, exported = outputs
    assert "predictions of 2 samples" in predicted
    assert re.search(r"finished: val/loss \d+\.\d+  val/perplexity \d+", validated)  # the base, not fitted
    assert f"starting from {ddp_run / 'checkpoints' / 'last.ckpt'}" in continued  # a file, under FSDP2
    last = newest["train"] / "checkpoints" / "last.ckpt"
    assert sharded.read_folder(last, weights=False)["global_step"] == 12  # 3 epochs of 4 steps
    assert "evaluated on the validation split" in evaluated and "val/loss" in evaluated
    answers = [json.loads(a) for a in (newest["predict"] / "predictions.jsonl").read_text().splitlines()]
    assert [a["prompt"] for a in answers] == ["Reverse the word kalo.", "Say mi twice."]
    assert all(isinstance(a["completion"], str) for a in answers)
    assert re.search(rf"wrote {re.escape(str(logs))}/export/runs/[^/]+/adapter ", exported)


def json_free(value: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested state, by dotted key."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    found: dict[str, torch.Tensor] = {}
    for key, item in items:
        found.update(json_free(item, f"{prefix}.{key}" if prefix else str(key)))
    return found


@pytest.mark.slow
def test_a_checkpoint_over_another_base_is_refused_in_one_sentence(
    lora_run: Run, llm_data: Path, tmp_path: Path
):
    from myproject.data import tiny_llm
    from myproject.models.causal_lm import CausalLMLoRA

    tiny_llm.make(tmp_path / "other", seed=1)  # the same architecture, other weights
    content = sharded.read_folder(lora_run.dir / "checkpoints" / "last.ckpt")
    lora = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    from hpctrain.runtime.distributed.materialize import materialize

    for base, refused in ((llm_data / "tiny_llm" / "base", False), (tmp_path / "other" / "base", True)):
        module = CausalLMLoRA({"path": str(base)}, lora, torch.optim.AdamW)
        materialize(module, "cpu")
        if not refused:
            trainable_only.load_weights(module, content, "last.ckpt")
            continue
        with pytest.raises(trainable_only.DifferentBase, match=r"was trained over another frozen base"):
            trainable_only.load_weights(module, content, "last.ckpt")


@pytest.mark.slow
def test_the_exports_load_with_peft_and_transformers_alone(lora_run: Run, llm_data: Path, tmp_path: Path):
    """export.format=peft: the adapters on the base give the trained logits exactly; hf_merged: within 1e-5,
    loaded by transformers alone, and it generates."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import hpctrain

    last = lora_run.dir / "checkpoints" / "last.ckpt"
    trained = hpctrain.load(
        str(last), [f"paths.data_dir={llm_data}"]
    ).model.eval()  # where its base is, as at training
    ids = torch.tensor([[4, 30, 31, 32, 33, 5, 40]])
    with torch.no_grad():
        want = trained(ids)
    for fmt, folder in (("peft", "adapter"), ("hf_merged", "merged")):
        result = run_entry(
            "export.py",
            f"ckpt_path={last}",
            f"export.format={fmt}",
            f"hydra.run.dir={tmp_path / fmt}",
            f"paths.data_dir={llm_data}",
        )
        assert_ok(result)
        assert f"wrote {tmp_path / fmt / folder}" in result.stdout
    adapter, merged = tmp_path / "peft" / "adapter", tmp_path / "hf_merged" / "merged"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in adapter.iterdir()
    }
    base = AutoModelForCausalLM.from_pretrained(str(llm_data / "tiny_llm" / "base"))
    merged_config = json.loads((merged / "config.json").read_text())
    assert merged_config["tie_word_embeddings"] is base.config.tie_word_embeddings is True  # as the base's
    with torch.no_grad():
        assert torch.equal(PeftModel.from_pretrained(base, str(adapter)).eval()(input_ids=ids).logits, want)
        alone = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
        assert (alone(input_ids=ids).logits - want).abs().max() < 1e-5
        assert alone.generate(input_ids=ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)


# ------------------------------------------------------------------------------------------ in one process


@pytest.fixture(scope="module")
def instructions(llm_data: Path, tmp_path_factory: pytest.TempPathFactory):
    from myproject.data.instructions import InstructionsDataModule

    def make(**settings):
        folder = llm_data / "tiny_llm"
        cache = tmp_path_factory.mktemp("tokens")
        return InstructionsDataModule(str(folder / "sft.jsonl"), str(folder / "base"), str(cache), **settings)

    return make


@pytest.mark.slow
def test_assistant_only_labels_are_the_assistants_turns(instructions):
    data = instructions(max_length=128)
    record = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Reverse the word kalo."},
            {"role": "assistant", "content": "olak"},
            {"role": "user", "content": "And lo?"},
            {"role": "assistant", "content": "ol"},
        ]
    }
    ids, labels = data.tokens(record)
    decode = data.tokenizer.decode
    assert (
        decode(ids)
        == "<|system|>Be brief.<|user|>Reverse the word kalo.<|assistant|>olak<|eos|><|user|>And lo?<|assistant|>ol<|eos|>"
    )
    kept = [i for i, label in enumerate(labels) if label != -100]
    assert decode([ids[i] for i in kept]) == "olak<|eos|>ol<|eos|>"
    assert all(labels[i] == ids[i] for i in kept)
    _, pair_labels = data.tokens({"prompt": "Say mi twice.", "completion": "mi mi"})
    assert decode([t for t in pair_labels if t != -100]) == "mi mi<|eos|>"
    all_ids, all_labels = instructions(loss_on="all").tokens(record)
    assert all_labels == all_ids
    with pytest.raises(UserError, match=r"data\.packing=concat packs plain text"):
        instructions(packing="concat")


@pytest.mark.slow
def test_packed_examples_attend_only_inside_themselves(instructions):
    """Two examples packed in one row give the logits each gives alone."""
    from myproject.models.causal_lm import CausalLMLoRA

    data = instructions(loss_on="all", packing="concat", max_length=24)
    data.check_available()
    data.setup()
    rows = [data.splits["train"][torch.tensor([i])] for i in range(8)]
    batch = next(r for r in rows if int((r["position_ids"][0] == 0).sum()) >= 2)  # a row of 2+ examples
    positions = batch["position_ids"][0]
    starts = [int(i) for i in torch.nonzero(positions == 0)]
    assert batch["attention_mask"].all() and batch["input_ids"].shape[1] == 24
    model = CausalLMLoRA({"path": str(data.tokenizer_path)}, {"r": 2}, torch.optim.AdamW, packing="concat")
    from hpctrain.runtime.distributed.materialize import materialize

    materialize(model, "cpu")
    model.eval()
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])[0]
        second, end = starts[1], [*starts, positions.numel()][2]
        ids = batch["input_ids"][:, second:end]
        alone = model(ids, torch.ones_like(ids))[0]
    assert torch.allclose(packed[second:end], alone, atol=1e-5)


@pytest.mark.slow
def test_tied_embeddings_and_mixed_dtypes_under_fsdp2(tmp_path: Path):
    """On a one-process gloo group: tied input and output embeddings where the embedding is asked to be a
    unit of its own stay with their parent and train and generate; a block whose trainable parameters have
    two dtypes is split so it trains; one module holding both is one sentence."""
    require_llm()
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hpctrain.runtime.distributed import fsdp

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )

        class Holder(nn.Module):
            def __init__(self, dtype_of_v: torch.dtype = torch.float32) -> None:
                super().__init__()
                net = AutoModelForCausalLM.from_config(config)
                self.net = get_peft_model(net, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
                for name, p in self.net.named_parameters():
                    if ".v_proj.lora_" in name:
                        p.data = p.data.to(dtype_of_v)

        tied = Holder()
        sharded_blocks, _ = fsdp.apply_fsdp(tied, mesh, {"shard": ["LlamaDecoderLayer", "Embedding"]})
        assert [type(b).__name__ for b in sharded_blocks] == ["FSDPLlamaDecoderLayer"] * 2
        ids = torch.tensor([[1, 2, 3]])
        tied.net.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # the first call
        tied.net(input_ids=ids, labels=ids).loss.backward()

        mixed = Holder(torch.bfloat16)
        fsdp.apply_fsdp(mixed, mesh, {"shard": "auto"})
        mixed.net(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None for n, p in mixed.named_parameters() if p.requires_grad)

        both = Holder()
        lora = next(
            m for n, m in both.named_modules() if n.endswith("layers.0.self_attn.q_proj.lora_A.default")
        )
        lora.bias = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        with pytest.raises(fsdp.FSDPOptionsError, match=r"holds trainable parameters of several dtypes"):
            fsdp.apply_fsdp(both, mesh, {"shard": "auto"})
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ quick


@pytest.mark.slow  # waits on timers (the quick tier waits on none)
def test_a_folder_is_made_once_while_the_others_wait(tmp_path: Path):
    from hpctrain.data.tokens import made_once

    made: list[str] = []

    def make(out: Path) -> None:
        time.sleep(0.3)
        (out / "manifest.json").write_text("{}")
        made.append(threading.current_thread().name)

    results: list[bool] = []
    threads = [
        threading.Thread(target=lambda: results.append(made_once(tmp_path / "set", make))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and sorted(results) == [False, False, True]
    assert (tmp_path / "set" / "manifest.json").is_file() and not list(tmp_path.glob(".set*"))
    assert made_once(tmp_path / "set", make) is False and len(made) == 1


def test_the_frozen_parts_fingerprint_tells_another_base_in_one_sentence():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    stored = trainable_only.fingerprint(model)
    assert stored["names"] == ["0.bias", "0.weight"]
    # auto: mostly frozen and read from files; a part frozen after init_from loaded it is stored whole
    assert trainable_only.mostly_frozen(model) and not trainable_only.rebuilt_from_source(model)
    model.pretrained_files = dict
    assert trainable_only.rebuilt_from_source(model)
    del model.pretrained_files
    trainable_only.check_same_base(stored, model, "x.ckpt")
    state = model.state_dict()
    hook = model.register_state_dict_post_hook(trainable_only.without_frozen(model))
    assert sorted(model.state_dict()) == ["1.bias", "1.weight"]
    hook.remove()
    with torch.no_grad():
        model[0].weight[0, 0] += 1e-3
    with pytest.raises(
        trainable_only.DifferentBase, match=r"x.ckpt was trained over another frozen base .* 0.weight differs"
    ):
        trainable_only.check_same_base(stored, model, "x.ckpt")
    model.load_state_dict(state)
    model[1].requires_grad_(False)
    with pytest.raises(trainable_only.DifferentBase, match=r"2 frozen parameters here it does not know"):
        trainable_only.check_same_base(stored, model, "x.ckpt")


def test_a_base_built_empty_is_read_from_its_files_and_a_missing_one_is_one_sentence(tmp_path: Path):
    require_modules("safetensors", install="pip install -e '.[llm]'")
    from safetensors.torch import save_file

    from hpctrain import empty_weights
    from hpctrain.runtime.distributed.materialize import PretrainedFilesError, materialize

    weights = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(3)}
    save_file(weights, str(tmp_path / "base.safetensors"))

    class Module(nn.Module):
        def __init__(self, names: dict[str, str]) -> None:
            super().__init__()
            with empty_weights():
                self.net = nn.Linear(4, 3)
            self.head = nn.Linear(3, 2)
            self.names = names

        def pretrained_files(self):
            return {p: (str(tmp_path / "base.safetensors"), k) for p, k in self.names.items()}

    module = Module({"net.weight": "w", "net.bias": "b"})
    assert module.net.weight.is_meta and not module.head.weight.is_meta
    head = module.head.weight.detach().clone()
    assert materialize(module, "cpu") == 2
    assert torch.equal(module.net.weight, weights["w"]) and torch.equal(module.head.weight, head)
    with pytest.raises(
        PretrainedFilesError,
        match=r"left 1 parameter\(s\) empty that pretrained_files\(\) does not name \(net.bias\)",
    ):
        materialize(Module({"net.weight": "w"}), "cpu")
    with pytest.raises(PretrainedFilesError, match=r"holds no tensor 'x' for parameter net.bias"):
        materialize(Module({"net.weight": "w", "net.bias": "x"}), "cpu")


def test_a_parameter_shared_by_two_modules_stays_shared_when_read_from_its_files(tmp_path: Path):
    """A tied output layer (the embedding's weight, stored once in the file) is the embedding after the
    base is read, not a tensor of its own left empty: a tied base trains against its real output layer."""
    require_modules("safetensors", install="pip install -e '.[llm]'")
    from safetensors.torch import save_file

    from hpctrain import empty_weights
    from hpctrain.runtime.distributed.materialize import materialize

    table = torch.arange(12.0).reshape(3, 4)
    save_file({"embed.weight": table}, str(tmp_path / "base.safetensors"))

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with empty_weights():
                self.net = nn.ModuleDict({"embed": nn.Embedding(3, 4), "head": nn.Linear(4, 3, bias=False)})
            self.net["head"].weight = self.net["embed"].weight

        def pretrained_files(self):
            return {"net.embed.weight": (str(tmp_path / "base.safetensors"), "embed.weight")}

    module = Tied()
    assert materialize(module, "cpu") == 1
    assert module.net["head"].weight is module.net["embed"].weight
    assert torch.equal(module.net["head"].weight, table)


def test_the_experiments_compose_with_the_names_the_guide_gives(tmp_path: Path):
    from hpctrain.runtime.config.compose import compose

    cfg = compose("train", ["experiment=lora_sft", f"paths.output_dir={tmp_path}"])
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.devices == 2 and cfg.trainer.accelerator == "cpu"
    assert cfg.model._target_ == "myproject.models.causal_lm.CausalLMLoRA"
    assert set(cfg.model.lora) == {"r", "alpha", "dropout", "target_modules"}
    assert (
        {"path", "config"} <= set(cfg.model.base)
        and cfg.data.loss_on == "assistant"
        and cfg.data.packing == "none"
    )
    assert cfg.checkpoints.trainable_only == "auto"
    gpu = compose(
        "train",
        [
            "experiment=lora_sft_gpu",
            "model.base.path=/m",
            "data.path=/d.jsonl",
            f"paths.output_dir={tmp_path}",
        ],
    )
    assert gpu.trainer.strategy == "fsdp" and gpu.trainer.precision == "bf16-mixed"
    assert gpu.model.base.dtype == "bfloat16" and gpu.dist.fsdp.activation_checkpointing
    assert gpu.data.tokenizer == "/m"
    # as slurm/train.sbatch runs it: its default trainer=ddp before the experiment; still FSDP2, bf16-mixed
    job = ["trainer=ddp", "experiment=lora_sft_gpu", "model.base.path=/m", "data.path=/d.jsonl"]
    sbatched = compose("train", [*job, f"paths.output_dir={tmp_path}"])
    assert sbatched.trainer.strategy == "fsdp" and sbatched.trainer.precision == "bf16-mixed"


@pytest.mark.ondemand  # CI: a LoRA run resumed mid-epoch (this file), Slurm requeues of DDP and FSDP2 jobs
@pytest.mark.slow
@pytest.mark.slurm
def test_a_lora_job_signalled_mid_epoch_requeues_and_ends_as_the_uninterrupted_one(
    slurm_cluster, llm_data: Path, tmp_path: Path
):
    """experiment=lora_sft over two Slurm nodes (one rank each): USR1 mid-epoch -> requeue.ckpt holding
    the adapters only -> scontrol requeue -> the restarted job reads the base from its folder again and
    ends with the uninterrupted job's adapters and optimizer state, bit for bit."""
    from tests.test_slurm import CPU_JOB, SBATCH_FILE, _output

    overrides = (
        "experiment=lora_sft",
        "trainer=fsdp_cpu",  # slurm/train.sbatch's trainer is the GPUs' unless the command names one
        f"paths.data_dir={llm_data}",
        *SHORT,
        "callbacks.progress.log_every_n_s=0",
        # written with `import lightning as L`, as the experiment's model is
        "+callbacks.slow._target_=tests.differential.user_code_lightning.SlowRankCallback",
        f"paths.log_dir={tmp_path}",
        "extras.print_config=false",
    )
    slow = {"PYTHONPATH": str(ROOT), "SLOW_RANK": "0", "SLOW_S": "1.0"}
    submit = (f"--output={tmp_path}/%x-%j.out", *CPU_JOB, SBATCH_FILE, *overrides)
    interrupted = slurm_cluster.sbatch(*submit, cwd=ROOT, env=slow)
    reference = slurm_cluster.sbatch(*submit, cwd=ROOT, env=slow)
    deadline = time.monotonic() + 400
    while "epoch 0/1  step 3/" not in (out := _output(tmp_path, interrupted)):
        assert time.monotonic() < deadline and "\nerror: " not in out, out[-3000:]  # a refusal: at once
        time.sleep(0.2)
    assert slurm_cluster.run("scancel", "--signal=USR1", interrupted).returncode == 0
    for job in (interrupted, reference):
        info = slurm_cluster.wait(job, timeout_s=600)
        assert info["JobState"] == "COMPLETED", _output(tmp_path, job)[-4000:]
    runs = tmp_path / "train" / "runs"
    resumed, uninterrupted = runs / f"slurm-{interrupted}", runs / f"slurm-{reference}"
    requeue_ckpt = resumed / "checkpoints" / "requeue.ckpt"
    log = _output(tmp_path, interrupted)
    assert f"starting from {requeue_ckpt} (restart 1 of this job)" in log
    assert (
        log.count("pretrained base: 20 tensors read into their shards") == 2
    )  # read again after the requeue
    assert all("lora_" in k for k in _keys(requeue_ckpt) if k.startswith("state_dict."))
    a, b = (_everything(r / "checkpoints" / "last.ckpt", tmp_path / r.name) for r in (resumed, uninterrupted))
    assert any(k.startswith("optimizer_0.state.") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_the_ten_node_command_is_checked_and_not_run(tmp_path: Path):
    result = run_script(
        "scripts/submit.py",
        "--dry-run",
        "--nodes",
        "10",
        "--gpus-per-node",
        "8",
        "--",
        "experiment=lora_sft_gpu",
        "model.base.path=/scratch/someone/models/llama",
        "data.path=/scratch/someone/sft.jsonl",
    )
    assert_ok(result)
    assert "sbatch --nodes=10 --ntasks-per-node=8 --gres=gpu:8" in result.stdout
    assert "experiment=lora_sft_gpu model.base.path=/scratch/someone/models/llama" in result.stdout


@pytest.mark.slow
@pytest.mark.ondemand
def test_validation_on_an_uneven_split_of_tokenized_data_under_fsdp2_matches_one_process(
    llm_data: Path, tmp_path: Path
):
    """33 validation examples (data.val_fraction=0.055 of 600) in batches of 4: shares of 17 and 16, five
    batches and four when batched plainly, which hung FSDP2 in the sanity check. Every rank runs five; the
    validation loss after a step that changes nothing (lr 1e-30) is one process's."""
    common = (
        "experiment=lora_sft",
        f"paths.data_dir={llm_data}",
        "data.val_fraction=0.055",
        "data.batch_size=4",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=1",
        "trainer.num_sanity_val_steps=-1",
        "model.optimizer.lr=1e-30",
        "callbacks.chat_sample=null",
    )
    one = train(tmp_path / "one", *common, "trainer=cpu")
    two = train(tmp_path / "two", *common, "dist.timeout_min=0.25", "dist.init_timeout_min=1")
    assert_ok(one)
    assert_ok(two)
    losses = [
        [float(r["val/loss"]) for r in read_metrics(run_dirs(tmp_path / name)[0]) if r.get("val/loss")]
        for name in ("one", "two")
    ]
    assert len(losses[0]) == 1 and losses[1] == pytest.approx(losses[0], rel=1e-5)


@pytest.mark.slow
def test_no_training_or_validation_step_makes_the_host_read_a_device_value(llm_data: Path, tmp_path: Path):
    """Counted where torch reads a tensor's value on the host (what makes a GPU wait): none in 4 training
    steps between logging steps (the token-weighted loss's all-reduce stays on the device), none in a
    validation step (the loss weighted by a device tensor)."""
    out = tmp_path / "reads.json"
    result = train(
        tmp_path,
        "experiment=lora_sft",
        "trainer=cpu",
        f"paths.data_dir={llm_data}",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=7",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=10",
        "trainer.accumulate_grad_batches=2",
        "callbacks.chat_sample=null",
        "+callbacks.reads._target_=tests.llm_code.CountHostReads",
        f"+callbacks.reads.out={out}",
        env={"PYTHONPATH": str(ROOT)},
        timeout=400,
    )
    assert_ok(result)
    reads = json.loads(out.read_text())
    # allowed: transformers' check that a padding mask lets sdpa use its causal kernel, once per forward
    # (a library's choice of the faster kernel), and the optimizer's step counters, which torch keeps on
    # the host (no GPU waits for them)
    allowed = ("masking_utils.py:", "optimizer.py:")
    found = {k: {p: n for p, n in v.items() if not p.startswith(allowed)} for k, v in reads.items()}
    assert found == {"train": {}, "val": {}}, reads
    assert reads["val"] and reads["train"]  # the counting sees what it should
