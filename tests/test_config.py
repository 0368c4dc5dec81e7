"""Every config option composes and builds, every datamodule gives a batch, every model fits some data and
every experiment runs a batch; the template's own models run a real batch of each of its data they fit.

A test that iterates over conf/ judges only what holds for every LightningModule and datamodule a user may
add, whatever its batches hold. Nothing here names a dataset's sizes: a model declares what it needs from
the data by its `${data.<key>}` references (e.g. `${data.num_classes}`, `${data.image_shape}`), and it is
composed with a data option that provides those keys. What a batch holds, (inputs, targets) of the sizes
the config gives, is a promise of the template's own options, checked on them by name (TEMPLATE_DATA,
TEMPLATE_MODELS); a user's model x data pair is checked by the contract tests (`pytest tests/contract
--model=... --data=...`). A new yaml file in conf/ therefore breaks a test here only if it is broken
itself (tests/test_users_configs.py adds three of other batch shapes).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hpctrain.runtime.config.checks import LOGGER_PACKAGES, check_config
from hpctrain.runtime.config.compose import compose, config_groups, group_options
from hpctrain.runtime.config.schema import PRECISIONS
from hpctrain.runtime.config.settings import Settings
from hpctrain.runtime.errors import UserError
from hpctrain.runtime.run import build
from tests.helpers import (
    EXAMPLES,
    IMAGE_DATA,
    PYTHON,
    ROOT,
    compose_train,
    composed,
    local_env,
    require_modules,
)
from tests.once import kept

GROUPS = (
    "data",
    "model",
    "model/net",
    "model/optimizer",
    "model/scheduler",
    "trainer",
    "callbacks",
    "logger",
)
GROUPS += ("debug", "experiment", "paths", "extras", "hparams_search")
NEEDS_HARDWARE = {"gpu", "ddp", "mps", "fsdp"}  # trainer options built here with the CPU accelerator


def options(group: str) -> list[str]:
    return list(group_options(group))


# The template's own data and models, by name: their batches are (inputs, targets), inputs of
# ${data.image_shape} and targets below ${data.num_classes}, and each model runs on each of these data it
# fits. A user's option in conf/ makes no such promise: its batches are its model's business.
TEMPLATE_DATA = (
    "cifar10",
    "digits",
    "fashion_mnist",
    "image_folder",
    "mnist",
    "plain_digits",
    "pystdlib_text",
    "random",
    "shards",
)
TEMPLATE_MODELS = ("autoencoder", "char_transformer", "mlp", "mnist_cnn", "resnet18")


OPTIONS = [(group, option) for group in GROUPS for option in options(group)]


def data_keys(model_option: str) -> frozenset[str]:
    """The `data.<key>`s a model option's config refers to (its declared needs)."""
    cfg = composed("train", f"model={model_option}")  # at collection, and again by tests: once per worker
    text = str(OmegaConf.to_container(cfg.model, resolve=False))
    return frozenset(re.findall(r"\$\{data\.([A-Za-z_]\w*)", text))


def provided_keys(data_option: str) -> set[str]:
    return set(composed("train", f"data={data_option}").data.keys())


def compatible_pairs() -> list[tuple[str, str]]:
    provided = {data: provided_keys(data) for data in options("data")}
    pairs = []
    for model in options("model"):
        needs = data_keys(model)
        pairs += [(model, data) for data, keys in provided.items() if needs and needs <= keys]
    return pairs


# at collection, by every worker: kept until a config or the composition's code changes
PAIRS = [
    tuple(pair)
    for pair in kept(
        "model-data-pairs",
        sorted((ROOT / "conf").rglob("*.yaml"))
        + sorted((ROOT / "src" / "hpctrain" / "conf").rglob("*.yaml"))
        + sorted((ROOT / "src" / "hpctrain" / "runtime" / "config").glob("*.py")),
        compatible_pairs,
    )
]


def _net(*overrides: str) -> str | None:
    """The net a composition builds (each net option asks about every model: each composed once per worker)."""
    return OmegaConf.select(composed("train", *overrides), "model.net._target_")


# Data of the user's: a root to read (written into the session's data dir) and its classes and shape.
DATA_ROOTS = {"image_folder": "digits_images", "shards": "digits_shards"}


def data_values(option: str) -> list[str]:
    """The root (and classes and shape) that data of the user's needs: none for the bundled data."""
    if option not in DATA_ROOTS:
        return []
    return [f"data.root=${{paths.data_dir}}/{DATA_ROOTS[option]}", *IMAGE_DATA]


# Each of the template's models x each of its data it fits runs a batch; files are read into the same
# tensors as the in-memory digits, so for image_folder and shards the quickstart model is enough.
BATCH_PAIRS = [
    (m, d)
    for m, d in PAIRS
    if m in TEMPLATE_MODELS and d in TEMPLATE_DATA and (d not in DATA_ROOTS or m == "mnist_cnn")
]


def _template_first(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The template's own pairs first: its options are composed as before whatever a user adds."""
    return sorted(pairs, key=lambda pair: (pair[0] not in TEMPLATE_MODELS, pair[1] not in TEMPLATE_DATA))


def partners(group: str, option: str) -> list[str]:
    """What an option is composed with: text data with a text model, a net inside a model that uses it,
    the user's own data with its root."""
    if group == "data":
        model = next((m for m, d in _template_first(PAIRS) if d == option), None)
        return ([f"model={model}"] if model else []) + data_values(option)
    if group == "model":
        data = next((d for m, d in _template_first(PAIRS) if m == option), None)
        return [f"data={data}"] if data else []
    if group == "model/net":
        owner = next((m for m in options("model") if _net(f"model={m}") == _net(f"model/net={option}")), None)
        return [f"model={owner}", f"model/net={option}", *partners("model", owner)] if owner else []
    return []


def test_the_object_graph_has_its_groups():
    assert {g for g, _ in OPTIONS} == set(GROUPS)
    assert ("experiment", "quickstart") in OPTIONS and ("trainer", "ddp_cpu") in OPTIONS
    assert {"adam", "adamw", "sgd"} <= set(options("model/optimizer"))
    assert {"none", "step", "cosine", "onecycle"} <= set(options("model/scheduler"))
    if EXAMPLES:  # the names the template's own checks select (a project without the examples has fewer)
        assert set(TEMPLATE_DATA) <= set(options("data")) and set(TEMPLATE_MODELS) <= set(options("model"))


def test_every_model_fits_some_data():
    fitting = {model for model, _ in PAIRS}
    unpaired = [m for m in options("model") if data_keys(m) and m not in fitting]
    assert not unpaired, f"models whose ${{data.*}} keys no data option provides: {unpaired}"
    assert ("mnist_cnn", "digits") in PAIRS and ("mlp", "random") in PAIRS


# Options that need a value of the user's to compose (an experiment that fine-tunes names no weights file).
NEEDS_VALUES = {
    ("experiment", "finetune_digits"): ["init_from.path=weights-of-a-quickstart-run.ckpt"],
    # ResNet-18 at the recipe's batch 512 in bf16-mixed: one step takes minutes on a CPU without bf16
    # instructions (emulated; 23 min for the test's three batches on the 2-core CI machine)
    ("experiment", "cifar10_resnet18"): ["data.batch_size=8", "trainer.precision=32-true"],
}

# The llm extra's options (docs/guides/fine-tune-a-language-model.md) with the tiny base and instructions
# that data.demo makes offline in the session's data dir; importing transformers takes seconds.
LLM_OPTIONS = {("model", "causal_lm_lora"), ("data", "instructions")}
LLM_VALUES = [
    "model=causal_lm_lora",
    "data=instructions",
    "model.base.path=${paths.data_dir}/tiny_llm/base",
    "data.tokenizer=${model.base.path}",
    "data.path=${paths.data_dir}/tiny_llm/sft.jsonl",
    "data.demo=true",
    "data.max_length=32",
]
LLM_EXPERIMENTS = {"lora_sft", "lora_sft_gpu"}
NEEDS_VALUES[("experiment", "lora_sft_gpu")] = [  # one batch on one CPU process: the GPUs' settings off
    *LLM_VALUES[2:],
    "model.base.dtype=float32",
    "trainer.strategy=auto",
    "trainer.precision=32-true",
    "dist.fsdp.activation_checkpointing=false",  # FSDP2's: refused under another strategy
]


def require_llm() -> None:
    require_modules("transformers", "peft", "tokenizers", install="pip install -e '.[llm]'")


# Loggers whose import alone takes seconds (mlflow, wandb): checked in the full suite, not the quick tier.
HEAVY_OPTIONS = {("logger", "mlflow"), ("logger", "wandb"), *LLM_OPTIONS}


@pytest.mark.parametrize(
    ("group", "option"),
    [pytest.param(g, o, marks=pytest.mark.slow) if (g, o) in HEAVY_OPTIONS else (g, o) for g, o in OPTIONS],
    ids=[f"{g}={o}" for g, o in OPTIONS],
)
def test_option_composes_and_passes_the_checks(group: str, option: str, tmp_path: Path, data_dir: Path):
    overrides = [] if group == "hydra" else [f"{group}={option}"]
    overrides += partners(group, option) + NEEDS_VALUES.get((group, option), [])
    if (group, option) in LLM_OPTIONS:
        require_llm()
        overrides = LLM_VALUES
        cfg = compose_train(tmp_path, data_dir, *overrides)
        build.check_data_available(build.datamodule(cfg.data, Settings.of(cfg)))  # the demo
    if group == "trainer" and option in NEEDS_HARDWARE:
        overrides += ["trainer.accelerator=cpu", "trainer.devices=1"]
    cfg = compose_train(tmp_path, data_dir, *overrides)
    if group == "data" and not any(d == option for _, d in PAIRS):
        # data no model option here declares a need for (your own LightningDataModule, with keys of its
        # own): its config resolves; the contract tests (tests/contract) train it with the model it belongs to
        assert OmegaConf.to_container(cfg.data, resolve=True)
        return
    if group == "logger":  # an optional extra (pip install -e '.[loggers]'): skipped, with why, without it
        for entry in (cfg.logger or {}).values():
            target = str((entry or {}).get("_target_", "")).lower()
            for package in LOGGER_PACKAGES:
                if package in target and importlib.util.find_spec(package) is None:
                    pytest.skip(f"logger={option} needs {package}, an optional extra that is not installed")
    if group == "trainer" and option.startswith("fsdp"):  # FSDP2, on GPUs and on CPU alike
        assert (
            type(build.strategy(Settings.of(cfg).trainer, Settings.of(cfg).dist)).__name__
            == "HydraModelParallelStrategy"
        )
    check_config(cfg)
    if group in ("trainer", "callbacks", "debug", "extras"):
        trainer = build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
        assert trainer.max_epochs == cfg.trainer.max_epochs
    elif group == "logger":
        loggers = build.loggers(cfg.logger)
        assert loggers, f"logger={option} built nothing"
        for logger in loggers:
            logger.log_metrics({"probe": 1.0}, step=0)
            logger.save()
    elif group in ("model", "model/net", "model/optimizer", "model/scheduler"):
        assert isinstance(build.model(cfg.model), torch.nn.Module)


@pytest.mark.parametrize(
    "option",
    [pytest.param(o, marks=pytest.mark.slow) if ("data", o) in LLM_OPTIONS else o for o in options("data")],
)
def test_data_option_yields_a_batch(option: str, tmp_path: Path, data_dir: Path):
    """Every datamodule gives a first training batch, of whatever shape its model takes: `(x,)`, `((x1, x2),
    y)`, a dict. The template's own data give (inputs, targets) of the sizes models read from the config."""
    overrides = [f"data={option}", *partners("data", option)]
    if ("data", option) in LLM_OPTIONS:
        require_llm()
        overrides = LLM_VALUES
    cfg = compose_train(tmp_path, data_dir, *overrides)
    datamodule = build.datamodule(cfg.data, Settings.of(cfg))
    build.check_data_available(datamodule)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()), None)
    assert batch is not None, f"data={option}: its train_dataloader() gives no batch"
    if option not in TEMPLATE_DATA:  # a user's batches: the contract tests train them with their model
        return
    inputs, targets = batch[0], batch[1]
    assert len(inputs) == len(targets) == cfg.data.batch_size
    if "image_shape" in cfg.data:  # what models read as ${data.image_shape} is what the batches hold
        assert tuple(inputs.shape[1:]) == tuple(cfg.data.image_shape)
    if "num_classes" in cfg.data:
        assert int(targets.max()) < cfg.data.num_classes


def _one_batch_of_everything(cfg, tmp_path: Path) -> None:
    """fast_dev_run: one real training, validation and test batch through the composed objects."""
    with build.namespace_of_run(cfg):  # the data and the trainer follow the model's Lightning package
        datamodule, module = build.datamodule(cfg.data, Settings.of(cfg)), build.model(cfg.model)
        trainer = build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
    build.check_data_available(datamodule)
    before = [p.detach().clone() for p in module.parameters()]
    trainer.fit(module, datamodule)
    if build.can_test(module, datamodule):  # as train.py: a module without a test_step is not tested
        trainer.test(module, datamodule)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))  # it learned
    assert all(torch.isfinite(v).all() for v in trainer.callback_metrics.values())


@pytest.mark.slow
@pytest.mark.parametrize(("model", "data"), BATCH_PAIRS, ids=[f"{m}-{d}" for m, d in BATCH_PAIRS])
def test_template_model_runs_a_batch_of_each_template_data_it_fits(
    model: str, data: str, tmp_path: Path, data_dir: Path
):
    """Fitting by its keys promises no batch shape: a user's model runs with its own data in its experiment
    (below) and in the contract tests."""
    overrides = (f"model={model}", f"data={data}", *data_values(data), "debug=fdr", "trainer=cpu")
    overrides += (
        ("data.batch_size=8",) if model == "resnet18" else ()
    )  # seconds, not tens of seconds, a batch
    cfg = compose_train(tmp_path, data_dir, *overrides)
    _one_batch_of_everything(cfg, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_runs_a_batch(experiment: str, tmp_path: Path, data_dir: Path):
    """An experiment names a model and the data it belongs with: a user's too runs a batch of each stage."""
    needs = NEEDS_VALUES.get(("experiment", experiment), [])
    if experiment in LLM_EXPERIMENTS:
        require_llm()
    cfg = compose_train(tmp_path, data_dir, f"experiment={experiment}", "debug=fdr", "trainer=cpu", *needs)
    check_config(cfg)
    if experiment in LLM_EXPERIMENTS:  # the demo's base and instructions, made before the model reads them
        build.check_data_available(build.datamodule(cfg.data, Settings.of(cfg)))
    _one_batch_of_everything(cfg, tmp_path)


def test_ddp_cpu_is_ddp_with_two_processes(tmp_path: Path, data_dir: Path):
    cfg = compose_train(tmp_path, data_dir, "trainer=ddp_cpu")
    trainer = build.trainer(cfg, Settings.of(cfg), tmp_path)
    assert type(trainer.strategy).__name__ == "HydraDDPStrategy"
    assert trainer.strategy._start_method == "popen"  # "ddp" starts processes by script, not "ddp_spawn"
    assert trainer.world_size == 2 and trainer.num_devices == 2


def test_monitor_is_one_setting(tmp_path: Path, data_dir: Path):
    cfg = compose_train(tmp_path, data_dir, "monitor.metric=val/loss", "monitor.mode=min")
    trainer = build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
    assert (trainer.checkpoint_callback.monitor, trainer.checkpoint_callback.mode) == ("val/loss", "min")
    stopping = trainer.early_stopping_callback
    assert (stopping.monitor, stopping.mode) == ("val/loss", "min")


def test_the_net_takes_its_sizes_from_the_data(tmp_path: Path, data_dir: Path):
    cfg = compose_train(tmp_path, data_dir, "data=random", "data.num_classes=7", "data.image_shape=[3,32,32]")
    module = build.model(cfg.model)
    assert module(torch.zeros(2, 3, 32, 32)).shape == (2, 7) and module.num_classes == 7


def test_predict_config_composes_and_refuses_a_split_it_does_not_know(tmp_path: Path):
    cfg = compose("predict", [f"paths.output_dir={tmp_path}", "ckpt_path=x.ckpt"])
    assert cfg.predict.split == "test" and cfg.predict.input is None and "progress" in cfg.callbacks
    check_config(cfg)
    with pytest.raises(UserError, match=r"predict.split='holdout' is not test, val or train"):
        check_config(
            compose("predict", [f"paths.output_dir={tmp_path}", "ckpt_path=x.ckpt", "predict.split=holdout"])
        )


def test_the_stacks_signal_may_not_be_the_requeue_signal(tmp_path: Path, data_dir: Path):
    cfg = compose_train(tmp_path, data_dir, "diagnostics.stacks_signal=SIGUSR1")
    with pytest.raises(UserError, match=r"diagnostics\.stacks_signal=SIGUSR1 is also requeue\.signal"):
        check_config(cfg)
    check_config(
        compose_train(tmp_path, data_dir, "diagnostics.stacks_signal=SIGUSR1", "requeue.enabled=false")
    )


def test_eval_config_composes(tmp_path: Path):
    cfg = compose("eval", [f"paths.output_dir={tmp_path}", "ckpt_path=x.ckpt"])
    assert cfg.ckpt_path == "x.ckpt" and "progress" in cfg.callbacks


# ------------------------------------------------------------------------------------------- callbacks

# conf/callbacks/default.yaml composes one file per callback; these are the values each file holds.
DEFAULT_CALLBACKS = {
    "model_checkpoint": {
        "_target_": "hpctrain.callbacks.model_checkpoint.ModelCheckpoint",
        "dirpath": "${paths.output_dir}/checkpoints",
        "filename": "epoch_{epoch:03d}",
        "monitor": "${monitor.metric}",
        "mode": "${monitor.mode}",
        "save_last": True,
        "save_top_k": 1,
        "auto_insert_metric_name": False,
    },
    "early_stopping": {
        "_target_": "hpctrain.callbacks.early_stopping.EarlyStopping",
        "monitor": "${monitor.metric}",
        "mode": "${monitor.mode}",
        "patience": 5,
        "min_delta": 0.0,
    },
    "lr_monitor": {
        "_target_": "pytorch_lightning.callbacks.LearningRateMonitor",
        "logging_interval": "epoch",
    },
    "model_summary": {"_target_": "pytorch_lightning.callbacks.ModelSummary", "max_depth": 2},
    "progress": {
        "_target_": "hpctrain.callbacks.progress_bar.progress_bar",
        "mode": "auto",
        "refresh_rate": 5,
        "log_every_n_s": 30,
    },
    "throughput": {"_target_": "hpctrain.callbacks.throughput_log.ThroughputLog"},
    "performance": {
        "_target_": "hpctrain.callbacks.performance_log.PerformanceLog",
        "data_wait_warn": 0.2,
        "every_n_steps": None,
        "flops": True,
        "peak_flops": None,
        "gpu_every_s": 5,
    },
}


def _callbacks(*overrides: str) -> dict:
    return OmegaConf.to_container(composed("train", *overrides).callbacks, resolve=False)


def test_default_callbacks_are_one_file_each():
    assert _callbacks() == _callbacks("callbacks=default") == DEFAULT_CALLBACKS
    assert list(_callbacks()) == list(DEFAULT_CALLBACKS)  # the order Lightning runs them in
    for name, entry in DEFAULT_CALLBACKS.items():
        assert _callbacks(f"callbacks={name}") == {name: entry}


def test_a_subset_of_callbacks_is_one_override():
    chosen = _callbacks("callbacks=[model_checkpoint,progress]")
    assert chosen == {k: DEFAULT_CALLBACKS[k] for k in ("model_checkpoint", "progress")}
    assert compose("train", ["callbacks=none"]).callbacks == {}


def test_a_null_callback_is_not_built(tmp_path: Path, data_dir: Path):
    assert _callbacks("callbacks.early_stopping=null") == {**DEFAULT_CALLBACKS, "early_stopping": None}
    cfg = compose_train(tmp_path, data_dir, "callbacks.early_stopping=null")
    trainer = build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
    assert trainer.early_stopping_callback is None and trainer.checkpoint_callback is not None


def test_a_users_callback_is_one_override_or_one_file(tmp_path: Path):
    target = "pytorch_lightning.callbacks.Timer"
    assert _callbacks(f"+callbacks.timer._target_={target}") == {
        **DEFAULT_CALLBACKS,
        "timer": {"_target_": target},
    }
    (tmp_path / "callbacks").mkdir()
    (tmp_path / "callbacks" / "timer.yaml").write_text(f"timer:\n  _target_: {target}\n")
    # a file in conf/callbacks/ needs no search path; here it lives in a test dir
    chosen = _callbacks(f"hydra.searchpath=[file://{tmp_path}]", "callbacks=[default,timer]")
    assert chosen == {**DEFAULT_CALLBACKS, "timer": {"_target_": target}}


# ------------------------------------------------------------------------------------------------ --help


def _conf_groups() -> dict[str, list[str]]:
    """Every folder of configs, the project's conf/ and hpctrain's, with its options: all but conf/local
    (git-ignored and optional: what it holds differs between machines)."""
    return {g: options(g) for g in config_groups() if g.split("/")[0] != "local"}


def _listed(text: str) -> dict[str, list[str]]:
    """The `group: option, option` lines of a help text."""
    return {
        group: options.split(", ") for group, options in re.findall(r"^([\w/]+): (.*)$", text, re.MULTILINE)
    }


def _help(script: str, flag: str = "--help") -> str:
    result = subprocess.run(
        [PYTHON, f"src/{script}.py", flag],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=local_env(),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow  # six runs of the entry points: what `--help` prints is the command line's
@pytest.mark.parametrize("script", ["train", "eval", "export"])
def test_help_lists_every_config_group_and_option(script: str):
    """A group or option added under conf/ shows in `--help`; the groups under conf/hydra (the
    launcher, the sweeper) beside Hydra's own in `--hydra-help`, as Hydra splits them."""
    ours = _conf_groups()
    app = {g: o for g, o in ours.items() if g != "hydra" and not g.startswith("hydra/")}
    assert {"data", "model", "model/net", "model/optimizer", "trainer"} <= set(app)
    listed = {g: o for g, o in _listed(_help(script)).items() if g != "local"}
    assert listed == app
    hydra_listed = _listed(_help(script, "--hydra-help"))
    for group in set(ours) - set(app):
        assert set(ours[group]) <= set(hydra_listed.get(group, [])), group


# Hydra lists groups through a fresh config repository each time, deep-copying every structured schema
# (about 120 copies here); hpctrain.runtime.config.command_line lists them from the app's repository instead.
COUNT_REPOSITORIES = """
import runpy, sys
from hydra._internal import config_repository

built = []
init = config_repository.CachingConfigRepository.__init__
def counted(self, delegate):
    built.append(self)
    init(self, delegate)
config_repository.CachingConfigRepository.__init__ = counted
sys.argv = ["src/train.py", "--help"]
try:
    runpy.run_path("src/train.py", run_name="__main__")
finally:
    print("repositories built:", len(built))
"""


@pytest.mark.slow  # a run of the entry point, counted from inside
def test_help_builds_one_config_repository():
    result = subprocess.run(
        [PYTHON, "-c", COUNT_REPOSITORIES],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**local_env(), "HPCTRAIN_ANSWER_CACHE": "0"},  # Hydra's own composition, not a stored answer
        timeout=60,
    )
    assert "data: " in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    assert "repositories built: 1\n" in result.stdout  # the composition's own; none per listing


@pytest.mark.slow  # nine runs of the entry point, four of them composing with Hydra
def test_a_repeated_question_is_answered_again_until_what_it_depends_on_changes(tmp_path: Path):
    """`--help` and `--cfg job` asked again give the same answer without Hydra (`answers`); a new option in
    conf/ shows at once; a mistake or `--resolve` (clock, environment) is never stored."""
    import shutil

    project = tmp_path / "project"  # a copy, so that adding an option leaves this project's conf/ alone
    for part in ("conf", "src"):
        shutil.copytree(ROOT / part, project / part, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**local_env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def ask(*args: str) -> tuple[subprocess.CompletedProcess[str], bool]:
        result = subprocess.run(
            [PYTHON, "-X", "importtime", str(project / "src" / "train.py"), *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=60,
        )
        return result, "hydra._internal.hydra" in result.stderr  # did Hydra compose this answer?

    for question in (["--help"], ["--cfg", "job", "experiment=quickstart"]):
        first, composed = ask(*question)
        assert first.returncode == 0 and composed, first.stderr[-3000:]
        again, composed = ask(*question)
        assert again.returncode == 0 and not composed, again.stderr[-3000:]
        assert again.stdout == first.stdout
    shutil.copy(project / "conf" / "data" / "digits.yaml", project / "conf" / "data" / "digits_copy.yaml")
    changed, composed = ask("--help")
    assert composed and "digits_copy" in _listed(changed.stdout)["data"]
    for question in (["--cfg", "job", "trainer.max_epoch=3"], ["--cfg", "job", "--resolve"]):
        for _ in range(2):
            _, composed = ask(*question)
            assert composed, question
    assert len(list((tmp_path / "cache" / "hpctrain" / "answers").iterdir())) == 3


@pytest.mark.parametrize(
    ("precision", "on_cpu", "flags", "said"),
    [
        ("bf16-mixed", True, {"avx2", "avx512f"}, True),  # no native bf16: emulated
        ("bf16-true", True, {"neon", "asimd"}, True),
        ("bf16", True, {"avx2", "avx512_bf16"}, False),  # AVX512-BF16
        ("bf16-mixed", True, {"amx_bf16", "amx_tile"}, False),  # AMX
        ("bf16-mixed", True, {"asimd", "bf16"}, False),  # Arm's BF16
        ("bf16-mixed", True, None, False),  # flags unknown (not Linux): say nothing rather than guess
        ("bf16-mixed", False, {"avx2"}, False),  # a GPU run
        ("32-true", True, {"avx2"}, False),
    ],
)
def test_emulated_bf16_is_named_with_the_override(precision: str, on_cpu: bool, flags, said: bool):
    from hpctrain.runtime.report.console import emulated_bf16_note

    note = emulated_bf16_note(precision, on_cpu, flags)
    assert (note is not None) == said
    if said:
        assert note.startswith(f"trainer.precision={precision} on a CPU without native bf16")
        assert note.endswith("pass trainer.precision=32-true for a quick try on this machine.")


@pytest.mark.parametrize(
    ("precision", "gpu", "capability", "said"),
    [
        ("bf16-mixed", "Tesla V100-SXM2-32GB", (7, 0), True),
        ("bf16-true", "Tesla T4", (7, 5), True),
        ("bf16-mixed", "NVIDIA A100-SXM4-80GB", (8, 0), False),
        ("bf16-mixed", "NVIDIA H200", (9, 0), False),
        ("16-mixed", "Tesla V100-SXM2-32GB", (7, 0), False),
        ("bf16-mixed", None, None, False),  # not on a GPU
    ],
)
def test_bf16_emulated_on_a_gpu_is_named_once_with_the_override(precision, gpu, capability, said):
    from hpctrain.runtime.report.console import emulated_bf16_gpu_note

    note = emulated_bf16_gpu_note(precision, gpu, capability)
    assert (note is not None) == said
    if said:
        assert note.startswith(f"trainer.precision={precision} on {gpu} (compute capability {capability[0]}.")
        assert note.endswith("pass trainer.precision=16-mixed.")
        # under FSDP2 Lightning refuses 16-mixed: the advice is one that runs there
        sharded = emulated_bf16_gpu_note(precision, gpu, capability, sharded=True)
        assert "pass trainer.precision=32-true" in sharded and "refuses 16-mixed" in sharded
        assert "trainer=ddp trainer.precision=16-mixed" in sharded


# Pure half precision needs an optimizer that tolerates it: Adam's eps=1e-8 rounds to 0 in float16.
HALF_SAFE = {"16-true": ("model/optimizer=sgd", "model.optimizer.lr=0.01")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "data", ["digits", "plain_digits"]
)  # uint8 batches normalised on the device; float batches
@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p not in ("16", "16-mixed")])
def test_every_precision_lightning_runs_on_cpu_trains(
    precision: str, data: str, tmp_path: Path, data_dir: Path
):
    cfg = compose_train(
        tmp_path,
        data_dir,
        f"data={data}",
        "debug=fdr",
        "trainer=cpu",
        f"trainer.precision={precision}",
        *HALF_SAFE.get(precision, ()),
    )
    check_config(cfg)
    _one_batch_of_everything(cfg, tmp_path)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("callbacks.model_checkpoint.save_last=false", "callbacks.model_checkpoint.save_last=False"),
        ("callbacks.model_checkpoint.dirpath=/elsewhere", "is not this run's checkpoint folder"),
    ],
)
def test_a_checkpoint_entry_that_resume_could_not_find_is_refused(
    override: str, says: str, tmp_path: Path, data_dir: Path
):
    cfg = compose_train(tmp_path, data_dir, "data=digits", "trainer=cpu", override)
    with pytest.raises(UserError, match=re.escape(says)):
        build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
    own = {"_target_": "pytorch_lightning.callbacks.ModelCheckpoint", "every_n_train_steps": 5}
    cfg = compose_train(
        tmp_path,
        data_dir,
        "data=digits",
        "trainer=cpu",
        *(f"+callbacks.mine.{k}={v}" for k, v in own.items()),
    )
    # a checkpoint callback of your own is Lightning's business: it is built and kept beside the template's
    trainer = build.trainer(cfg, Settings.of(cfg), tmp_path, logger=False)
    mine = [
        c for c in trainer.checkpoint_callbacks if c.dirpath is None or "checkpoints" not in str(c.dirpath)
    ]
    assert [c._every_n_train_steps for c in mine] == [5]


@pytest.mark.slow  # a copy of the project and two runs of its entry point
def test_help_names_both_config_sources_and_an_option_the_project_replaces(tmp_path: Path):
    """A file of hpctrain's group and name in the project's conf/ wins, and --help says it replaces one."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "conf", project / "conf", ignore=shutil.ignore_patterns("local"))
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (project / "conf" / "trainer").mkdir(exist_ok=True)  # a project may have trainer options of its own
    (project / "conf" / "trainer" / "cpu.yaml").write_text(
        "defaults:\n  - default\n  - _self_\naccelerator: cpu\ndevices: 1\nmax_epochs: 7\n"
    )
    env = {**local_env(), "HPCTRAIN_ANSWER_CACHE": "0"}
    shown = subprocess.run(
        [PYTHON, "src/train.py", "--help"], cwd=project, env=env, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert (
        "Configs are read from conf/ (this project's), then from hpctrain's (src/hpctrain/conf)"
        in shown.stdout
    )
    assert "Options of hpctrain's that this project replaces: trainer/cpu" in shown.stdout
    composed = subprocess.run(
        [PYTHON, "src/train.py", "--cfg", "job", "trainer=cpu"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert "max_epochs: 7" in composed.stdout, composed.stderr[-2000:]
