"""The examples each entry point's `--help` ends with (`${help_examples:<entry>}` in hpctrain's
hydra/default.yaml): its own commands, never another entry point's. tests/test_docs.py composes each one.
No torch here."""

from __future__ import annotations

CHECKPOINT = "logs/train/runs/<run>/checkpoints/last.ckpt"

EXAMPLES: dict[str, list[str]] = {
    "train": [
        "python src/train.py experiment=quickstart",
        "python src/train.py experiment=quickstart trainer=ddp_cpu trainer.max_epochs=3",
        "python src/train.py experiment=quickstart ckpt_path=last trainer.max_epochs=20   # continue",
        "python src/train.py -m experiment=quickstart model.optimizer.lr=0.01,0.001        # a sweep",
        "sbatch --nodes=2 --ntasks-per-node=8 --gres=gpu:8 slurm/train.sbatch experiment=mnist_cnn",
    ],
    "eval": [
        f"python src/eval.py ckpt_path={CHECKPOINT}",
        f"python src/eval.py ckpt_path={CHECKPOINT} paths.data_dir=<dir>   # the data read from <dir>",
    ],
    "predict": [
        f"python src/predict.py ckpt_path={CHECKPOINT}   # the test split",
        f"python src/predict.py ckpt_path={CHECKPOINT} predict.input=photos/   # a folder of images",
        f"python src/predict.py ckpt_path={CHECKPOINT} predict.split=val predict.output=val.csv",
    ],
    "export": [
        f"python src/export.py ckpt_path={CHECKPOINT} export.format=onnx",
        f"python src/export.py ckpt_path={CHECKPOINT} export.format=torch_export",
        f"python src/export.py ckpt_path={CHECKPOINT} export.format=safetensors",
    ],
}


def examples(entry: str) -> str:
    """The `Examples:` lines of `python src/<entry>.py --help` (an entry point of the project's own, none)."""
    found = EXAMPLES.get(str(entry))
    if not found:
        return ""
    return "\n".join(["Examples:", *(f"  {line}" for line in found)])
