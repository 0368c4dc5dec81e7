"""The bases people fine-tune (tests/llm_bases.py: one table of their shapes and flags), each under each
strategy: `experiment=lora_sft` on the base's folder, its own tokenizer and chat template, replayed outside
the template (tests/llm_reference.py: transformers, peft and torch's AdamW alone) on the batches it ran.

Each cell is one short run: a validation of the base before the first step (the sanity check, every
val batch), 4 micro-batches in 2 optimizer steps (`accumulate_grad_batches=2`), a validation, a generated
sample and a checkpoint. It proves that the step-0 val/loss is transformers' own over the same tokens
(<= 1e-4), that each step's train/loss is the reference's (<= 1e-4) and that the adapters after the last
step are the reference's (<= 1e-5). Per base, beyond it: a resume, the evaluation of its checkpoint,
generation with src/predict.py and both exports.

CI runs the cells of CI_CELLS (a tied base with Conv1D layers and no pad token on one process, a tied
ChatML base under FSDP2, a sliding-window base under DDP); the others run with `pytest --ondemand`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from hpctrain.runtime.errors import UserError
from hpctrain.runtime.storage.checkpoints import trainable_only
from tests import llm_reference as reference
from tests.helpers import ROOT, assert_ok, read_metrics, require_modules, run_dirs, run_entry, train
from tests.llm_bases import BASES, make

STRATEGIES = ("cpu", "ddp_cpu", "fsdp_cpu")
CI_CELLS = {("gpt2", "cpu"), ("qwen2.5", "fsdp_cpu"), ("mistral", "ddp_cpu")}
LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
LR = 0.003
# Adam divides each gradient by its running size plus eps: an element whose first gradient is float32
# noise (a cancellation, ~1e-9) moves by up to lr either way at torch's eps=1e-8, whoever computes it.
# At 1e-6 such an element moves by lr/1000 at most, and the adapters compare within 1e-5 on every base.
EPS = 1e-6
ACCUMULATE = 2


def cells() -> list:
    return [
        pytest.param(name, strategy, marks=() if (name, strategy) in CI_CELLS else pytest.mark.ondemand)
        for name in BASES
        for strategy in STRATEGIES
    ]


def require_llm() -> None:
    require_modules("transformers", "peft", "tokenizers", "safetensors", install="pip install -e '.[llm]'")


@pytest.fixture(scope="session")
def base_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every base of the table, made once for the session, with 160 instructions beside it."""
    require_llm()
    from myproject.data import tiny_llm

    root = tmp_path_factory.mktemp("bases")
    records = tiny_llm.instructions(160)
    return {name: make(base, root / name, records) for name, base in BASES.items()}


def run_cell(folder: Path, strategy: str, logs: Path, *extra: str):
    return train(
        logs,
        "experiment=lora_sft",
        f"trainer={strategy}",
        f"model.base.path={folder}",
        f"data.path={folder / 'sft.jsonl'}",
        "data.demo=false",
        f"data.cache_dir={logs / 'tokenized'}",
        "data.max_length=128",  # Qwen's default system prompt alone is 60 tokens here
        "data.batch_size=4",
        "data.val_fraction=0.1",  # 16 examples: 2 batches a rank on 2 ranks
        f"model.lora.r={LORA['r']}",
        f"model.lora.alpha={LORA['alpha']}",
        f"model.lora.target_modules={LORA['target_modules']}",
        f"model.optimizer.lr={LR}",
        f"+model.optimizer.eps={EPS}",
        "model/scheduler=none",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=4",
        f"trainer.accumulate_grad_batches={ACCUMULATE}",
        "trainer.limit_val_batches=2",
        "trainer.num_sanity_val_steps=-1",  # the whole (limited) val split before the first step
        "trainer.log_every_n_steps=1",
        "callbacks.chat_sample.max_new_tokens=4",
        "+callbacks.record._target_=tests.llm_code.RecordSteps",
        f"+callbacks.record.dir={logs / 'record'}",
        "dist.timeout_min=0.5",
        "dist.init_timeout_min=3",
        *extra,
        env={"PYTHONPATH": str(ROOT)},
        timeout=400,
    )


class Cell(NamedTuple):
    folder: Path  # the base's
    logs: Path
    run: Path
    stdout: str


@pytest.fixture(scope="session")
def trained(base_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """The run of a cell (base, strategy), made once for the session by the first test that asks."""
    made: dict[tuple[str, str], Cell] = {}

    def cell(name: str, strategy: str) -> Cell:
        if (name, strategy) not in made:
            logs = tmp_path_factory.mktemp(f"{name}-{strategy}")
            recompute = f"model.gradient_checkpointing={strategy == 'fsdp_cpu'}"  # a model option under FSDP2
            result = run_cell(base_folders[name], strategy, logs, "checkpoints.async_save=true", recompute)
            assert_ok(result)
            (run,) = run_dirs(logs)
            made[name, strategy] = Cell(base_folders[name], logs, run, result.stdout)
        return made[name, strategy]

    return cell


@pytest.mark.slow
@pytest.mark.parametrize(("name", "strategy"), cells())
def test_a_base_trains_as_transformers_and_peft_alone_train_it(trained, name: str, strategy: str):
    cell = trained(name, strategy)
    records, params = reference.read(cell.logs / "record")
    assert len(records) == (1 if strategy == "cpu" else 2)

    # the base before the first step: transformers' own loss over the same tokens
    val = [b for r in records for b in r["val"]]
    assert all(r["val_loss"] == records[0]["val_loss"] for r in records)
    want = reference.val_loss(cell.folder, val)
    assert abs(records[0]["val_loss"] - want) <= 1e-4, (records[0]["val_loss"], want)

    # each optimizer step: the loss over the step's tokens, all micro-batches and ranks, and the adapters
    steps = reference.steps_of(records, ACCUMULATE)
    assert len(steps) == 2 and sorted(params) == [0, 1, 2]
    model = reference.adapted(cell.folder, LORA, params[0])
    optimizer = torch.optim.AdamW(list(reference.trainable(model).values()), lr=LR, eps=EPS, weight_decay=0.0)
    losses = reference.replay(model, steps, optimizer)
    logged = [float(r["train/loss"]) for r in read_metrics(cell.run) if r.get("train/loss")]
    assert logged == pytest.approx(losses, abs=1e-4)
    final = reference.trainable(model)
    worst = max((params[2][n] - p.detach()).abs().max().item() for n, p in final.items())
    assert worst <= 1e-5, worst
    assert "sample after epoch 0:" in cell.stdout  # generated after the validation, on every rank

    # its checkpoint, written while training went on: the adapters alone, over the base's fingerprint
    last = cell.run / "checkpoints" / "last.ckpt"
    if last.is_dir():
        stored = [k.removeprefix("state_dict.") for k in _keys(last) if k.startswith("state_dict.")]
    else:
        content = torch.load(last, weights_only=True, map_location="cpu")
        stored = list(content["state_dict"])
        assert trainable_only.stored(content) is not None
    assert sorted(stored) == sorted(final)


def _keys(folder: Path) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return list(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("cpu", marks=pytest.mark.ondemand), "ddp_cpu"])
def test_accumulated_micro_batches_on_any_ranks_give_the_gradient_of_one_batch(
    base_folders: dict[str, Path], strategy: str, tmp_path: Path
):
    """2 micro-batches (on one process, and on each of 2), one SGD step at lr=1 without momentum: the
    adapters moved by exactly the gradient of the mean loss over all their tokens taken as one batch, as
    transformers (>= 4.46) and TRL weight them, not by the mean of per-batch means."""
    folder = base_folders["llama-3.2"]
    result = run_cell(
        folder,
        strategy,
        tmp_path,
        "model/optimizer=sgd",
        "~model.optimizer.eps",  # run_cell's AdamW setting: SGD takes none
        "model.optimizer.lr=1.0",
        "model.optimizer.momentum=0.0",
        "model.optimizer.nesterov=false",
        "model.optimizer.weight_decay=0.0",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "model.gradient_checkpointing=true",  # recomputed activations give the same gradient, under DDP too
    )
    assert_ok(result)
    records, params = reference.read(tmp_path / "record")
    (examples,) = reference.steps_of(records, ACCUMULATE)
    counts = [reference.tokens(b) for b in examples]
    assert len(examples) == ACCUMULATE * len(records) and len(set(counts)) > 1, counts  # unequal batches
    want = reference.gradient(reference.adapted(folder, LORA, params[0]), examples)
    moved = {n: params[0][n] - params[1][n] for n in want}
    scale = max(g.abs().max().item() for g in want.values())
    worst = max((moved[n] - g).abs().max().item() for n, g in want.items())
    assert worst <= 1e-6 * max(scale, 1.0), (worst, scale)


AFTER_CI: set[str] = set()  # CI runs the guide's lines instead (tests/test_llm.py), on the tied demo base


def after_training() -> list:
    """Each base under the strategy of its CI cell, else FSDP2."""
    strategy = {name: s for name, s in CI_CELLS}
    return [
        pytest.param(
            name, strategy.get(name, "fsdp_cpu"), marks=() if name in AFTER_CI else pytest.mark.ondemand
        )
        for name in BASES
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "strategy"), after_training())
def test_a_trained_base_resumes_evaluates_answers_prompts_and_exports(trained, name: str, strategy: str):
    """From its cell's checkpoint, under the same strategy: one more epoch (2 more steps); the val split
    evaluated; greedy answers to a JSONL of prompts, in input order; both exports, each checked by loading
    it back with transformers and peft alone, the merged one tied as the base is."""
    cell = trained(name, strategy)
    last = cell.run / "checkpoints" / "last.ckpt"
    resumed = run_cell(cell.folder, strategy, cell.logs, f"ckpt_path={last}", "trainer.max_epochs=2")
    assert_ok(resumed)
    assert f"starting from {last}" in resumed.stdout
    where = (f"paths.log_dir={cell.logs}", f"trainer={strategy}", "dist.timeout_min=0.5")
    evaluated = run_entry("eval.py", f"ckpt_path={last}", *where, timeout=400)
    assert_ok(evaluated)
    assert re.search(r"finished: val/loss \d", evaluated.stdout)

    prompts = cell.logs / "prompts.jsonl"
    asked = [
        "Reverse the word kalo.",
        "Say mi twice.",
        "What number comes after 41?",
        "Spell to in capitals.",
    ]
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in asked))
    answered = run_entry(
        "predict.py",
        f"ckpt_path={last}",
        f"predict.input={prompts}",
        "predict.batch_size=2",  # left-padded rows of different lengths, one batch a rank
        "+model.generation.max_new_tokens=6",
        *where,
        timeout=400,
    )
    assert_ok(answered)
    (output,) = (cell.logs / "predict" / "runs").glob("*/predictions.jsonl")
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [(r["index"], r["prompt"]) for r in rows] == list(enumerate(asked))

    base_config = json.loads((cell.folder / "config.json").read_text())
    for fmt, folder in (("peft", "adapter"), ("hf_merged", "merged")):
        exported = run_entry(
            "export.py", f"ckpt_path={last}", f"export.format={fmt}", f"paths.log_dir={cell.logs}"
        )
        assert_ok(exported)
        (written,) = (cell.logs / "export" / "runs").glob(f"*/{folder}")
        assert (written / "model_card.md").is_file()
    merged = json.loads(next((cell.logs / "export" / "runs").glob("*/merged/config.json")).read_text())
    assert merged.get("tie_word_embeddings") == base_config["tie_word_embeddings"]


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_each_layer_and_keeps_the_gradient(base_folders):
    """model.gradient_checkpointing=true: every decoder layer runs again in the backward, and the adapters'
    gradient is the one without it (within float32's rounding)."""
    from hpctrain.runtime.distributed.materialize import materialize
    from myproject.models.causal_lm import CausalLMLoRA

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    grads, calls = [], []
    for recompute in (False, True):
        torch.manual_seed(0)  # the same adapters
        model = CausalLMLoRA(
            {"path": str(base_folders["llama-3.2"])},
            {"r": 2},
            torch.optim.AdamW,
            gradient_checkpointing=recompute,
        )
        materialize(model, "cpu")
        first = model.net.get_base_model().model.layers[0].input_layernorm  # run again when recomputed
        first.register_forward_hook(lambda *_, on=recompute: calls.append(on))
        model.train()
        total, _ = model.loss(batch)
        total.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert calls.count(False) == 1 and calls.count(True) == 2  # forward, and again in the backward
    worst = max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0])
    assert worst <= 1e-6, worst


@pytest.mark.slow
def test_activation_checkpointing_of_fsdp_under_another_strategy_is_refused_naming_the_model_option(tmp_path):
    from hpctrain.runtime.config.checks import check_config
    from hpctrain.runtime.config.compose import compose

    cfg = compose(
        "train",
        [
            "experiment=lora_sft",
            "trainer=ddp_cpu",
            "dist.fsdp.activation_checkpointing=true",
            f"paths.output_dir={tmp_path}",
        ],
    )
    with pytest.raises(
        UserError,
        match=r"^dist.fsdp.activation_checkpointing=true recomputes FSDP2's blocks, but trainer.strategy=ddp; .*model.gradient_checkpointing=true",
    ):
        check_config(cfg)


@pytest.mark.slow
def test_a_base_in_4_bits_trains_its_adapters_in_their_dtype(base_folders):
    """model.base.quantization=nf4 (QLoRA): every frozen linear layer of the base stored as torchao's NF4
    (about an eighth of its float32 bytes), its logits within the quantization's error of the base's, the
    adapters float32 with a gradient; dequantized, the layers give back the values it computed with."""
    require_modules("torchao", install="pip install -e '.[llm]'")
    from hpctrain.runtime.distributed.materialize import materialize
    from myproject.models.causal_lm import CausalLMLoRA

    def built(**base):
        torch.manual_seed(0)
        model = CausalLMLoRA({"path": str(base_folders["qwen2.5"]), **base}, {"r": 2}, torch.optim.AdamW)
        materialize(model, "cpu")
        return model

    def frozen_bytes(model) -> int:
        inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
        total = 0
        for name, p in model.named_parameters():
            if not p.requires_grad and "layers." in name:
                parts = [getattr(p, k) for k in inner] if hasattr(p, "quantized_data") else [p]
                total += sum(t.numel() * t.element_size() for t in parts)
        return total

    full, four = built(), built(quantization="nf4")
    layers = [
        m
        for m in four.net.modules()
        if isinstance(m, torch.nn.Linear) and hasattr(m.weight, "quantized_data")
    ]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    assert frozen_bytes(four) * 5 < frozen_bytes(full), (frozen_bytes(four), frozen_bytes(full))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (four(ids) - full(ids)).abs().max().item()
    assert 0 < difference < 0.5, difference  # the 4-bit codes' error, on logits of about unit size
    total, _ = four.loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    total.backward()
    adapters = [p for p in four.parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 and p.grad is not None for p in adapters)
    with torch.no_grad():
        before = four(ids)
        assert four.dequantize() == 14 and torch.allclose(four(ids), before, atol=1e-5)


@pytest.mark.slow
@pytest.mark.ondemand
def test_qlora_trains_under_ddp_exports_merged_and_is_refused_under_fsdp2_and_as_adapters(
    base_folders, tmp_path: Path
):
    require_modules("torchao", install="pip install -e '.[llm]'")
    folder = base_folders["qwen2.5"]
    result = run_cell(
        folder, "ddp_cpu", tmp_path, "model.base.quantization=nf4", "trainer.limit_val_batches=1"
    )
    assert_ok(result)
    (run,) = run_dirs(tmp_path)
    last = run / "checkpoints" / "last.ckpt"
    merged = run_entry(
        "export.py", f"ckpt_path={last}", "export.format=hf_merged", f"paths.log_dir={tmp_path}"
    )
    assert_ok(merged)  # checked against the trained model over its dequantized base, with transformers alone
    adapters = run_entry("export.py", f"ckpt_path={last}", "export.format=peft", f"paths.log_dir={tmp_path}")
    assert (
        adapters.returncode == 2
        and "trained over its quantized weights (14 layers in 4 bits)" in adapters.stdout
    )
    sharded = run_cell(folder, "fsdp_cpu", tmp_path / "fsdp", "model.base.quantization=nf4")
    assert sharded.returncode == 2, sharded.stdout[-2000:]
    assert "error: model.base.quantization=nf4 quantizes the base once it is read whole" in sharded.stdout


# ------------------------------------------------------------------------------------------ refusals


def _build(folder: Path, **settings):
    from myproject.models.causal_lm import CausalLMLoRA

    lora = {"r": 2, "target_modules": settings.pop("targets", "all-linear")}
    return CausalLMLoRA({"path": str(folder)}, lora, torch.optim.AdamW, **settings)


@pytest.mark.slow
def test_target_modules_that_adapt_nothing_are_refused_naming_the_linear_layers(base_folders):
    """Adapters on no layer, or a typo among several names (PEFT drops it silently): one sentence naming
    the unmatched names and the model's linear layers, before anything is built."""
    for name, targets, unmatched, layers in (
        (
            "llama-3.2",
            ["q_proj", "v_prj"],
            "v_prj",
            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        ),
        ("gpt2", ["q_proj", "v_proj"], "q_proj, v_proj", "c_attn, c_proj, c_fc"),
        ("phi-3", r".*\.q_proj", r".*\.q_proj", "o_proj, qkv_proj, gate_up_proj, down_proj"),
    ):
        with pytest.raises(UserError) as refused:
            _build(base_folders[name], targets=targets)
        assert str(refused.value).startswith(f"model.lora.target_modules: {unmatched} names no linear layer")
        assert f"whose linear layers are {layers};" in str(refused.value)
    assert _build(base_folders["gpt2"], targets=["c_attn"])  # the name of a Conv1D layer
    assert _build(base_folders["phi-3"], targets=r".*\.qkv_proj")  # a regular expression, as PEFT takes it


@pytest.mark.slow
def test_a_base_folder_that_cannot_be_read_safely_or_fully_is_one_sentence(base_folders, tmp_path: Path):
    import shutil

    with pytest.raises(UserError, match=r"data.max_length=2048 is beyond the base's 1024 positions"):
        _build(base_folders["gpt2"], max_length=2048)
    assert _build(base_folders["gpt2"], max_length=1024)

    pickled = tmp_path / "pickled"
    shutil.copytree(base_folders["gpt2"], pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")  # never read: refused by name
    with pytest.raises(UserError, match=rf"model.base.path={pickled} holds pytorch_model.bin only, a format"):
        _build(pickled)

    # a config asking for the folder's own code: never run, never asked about
    own = tmp_path / "own"
    shutil.copytree(base_folders["phi-3"], own)
    ran = tmp_path / "ran"
    (own / "modeling_phi3.py").write_text(f"open({str(ran)!r}, 'w')\n")
    config = json.loads((own / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    (own / "config.json").write_text(json.dumps(config))
    assert type(_build(own).net.get_base_model()).__module__.startswith(
        "transformers."
    )  # transformers' Phi-3
    config["model_type"] = "phi3_custom"
    (own / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"asks to run its own Python code \(auto_map in config.json"):
        _build(own)
    assert not ran.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "sentence"),
    [
        (
            "model.base.path={missing}",
            "error: model.base.path={missing} does not exist; pass a local Hugging Face model folder",
        ),
        (
            "model.lora.target_modules=[q_proj,v_prj]",
            "error: model.lora.target_modules: v_prj names no linear layer",
        ),
    ],
)
def test_a_mistake_in_the_model_is_one_sentence_and_exit_2_before_tokenizing(
    base_folders, tmp_path: Path, override: str, sentence: str
):
    missing = tmp_path / "no-such-base"
    folder = base_folders["llama-3.2"]
    result = train(
        tmp_path,
        "experiment=lora_sft",
        "trainer=cpu",
        f"model.base.path={folder}",
        f"data.path={folder / 'sft.jsonl'}",
        "data.demo=false",
        f"data.cache_dir={tmp_path / 'tokenized'}",
        override.format(missing=missing),
        timeout=120,
    )
    assert result.returncode == 2, result.stdout[-2000:]
    assert sentence.format(missing=missing) in result.stdout + (result.stderr or "")
    assert "Traceback" not in result.stdout + (result.stderr or "")
    assert not list(tmp_path.glob("tokenized/instructions-*"))  # nothing tokenized
