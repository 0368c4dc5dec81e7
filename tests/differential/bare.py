"""The oracle: a case trained by a plain `pl.Trainer` script, as a user of bare Lightning would write it.

    python tests/differential/bare.py CASE OUT_DIR [--max-epochs N] [--ckpt-path FILE] [--save-at STEP FILE]
        [--package pytorch_lightning|lightning]

Writes OUT_DIR/metrics.csv (Lightning's CSVLogger), OUT_DIR/checkpoints/, OUT_DIR/hooks-rank<R>.json
(the recorder) and OUT_DIR/final.pt (the weights when fit ended). `--package lightning`: the user code
written with `import lightning as L`, under the `lightning` package's Trainer.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402

from tests.differential.cases import (  # noqa: E402
    CASES,
    SEED,
    TRAINER,
    WRITTEN_WITH,
    callback_configs,
    config_of,
    written_with,
)

TRAINER_PACKAGE = {"pytorch_lightning": "pytorch_lightning", "lightning": "lightning.pytorch"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-epochs", type=int)
    parser.add_argument("--ckpt-path")
    parser.add_argument("--save-at", nargs=2)
    parser.add_argument("--package", choices=sorted(WRITTEN_WITH), default="pytorch_lightning")
    args = parser.parse_args()
    case = CASES[args.case]
    # the Trainer, logger and strategy of the package the user code imports, as its user would write them
    pl = importlib.import_module(TRAINER_PACKAGE[args.package])
    user_code = importlib.import_module(WRITTEN_WITH[args.package])
    is_overridden = importlib.import_module(f"{pl.__name__}.utilities.model_helpers").is_overridden
    os.environ["DIFF_OUT"] = str(args.out)
    args.out.mkdir(parents=True, exist_ok=True)

    pl.seed_everything(SEED, workers=True)
    data = instantiate(written_with(args.package, config_of(case, "data")), _convert_="all")
    model = instantiate(written_with(args.package, config_of(case, "model")), _convert_="all")
    callbacks = [
        instantiate(c, _convert_="all")
        for c in callback_configs(case, str(args.out / "checkpoints"), args.package).values()
    ]
    if args.save_at:
        callbacks.append(user_code.SaveAtStep(int(args.save_at[0]), args.save_at[1]))
    options = {**TRAINER, **case.trainer}
    if args.max_epochs:
        options["max_epochs"] = args.max_epochs
    if case.processes > 1:
        options["strategy"] = pl.strategies.DDPStrategy(find_unused_parameters=case.find_unused_parameters)
    csv = pl.loggers.CSVLogger(args.out, name="", version="")
    tensorboard = (
        [pl.loggers.TensorBoardLogger(args.out, name="tensorboard")] if case.bare_tensorboard else []
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=case.processes,
        logger=[*tensorboard, csv],
        callbacks=callbacks,
        enable_model_summary=False,
        **options,
    )
    trainer.fit(model, data, ckpt_path=args.ckpt_path)
    if trainer.is_global_zero:
        torch.save(model.state_dict(), args.out / "final.pt")
    if is_overridden("test_step", model):
        best = "best" if trainer.checkpoint_callback.best_model_path else None
        trainer.test(model, data, ckpt_path=best, weights_only=case.bare_test_weights_only)


if __name__ == "__main__":
    main()
