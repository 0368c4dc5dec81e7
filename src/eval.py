"""Evaluate a checkpoint: python src/eval.py ckpt_path=<path/to/file.ckpt> [eval.split=test|val] [key=value ...]

The checkpoint proposes the options and values it was trained with; this project's configs compose the
model and data from them (model=..., data=..., <key>=... on the command line win). The test split where the
model has a `test_step` and the data a test split, else the validation split (said in one line);
`eval.split` chooses. The lifecycle is train.py's (`job`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without `pip install -e .`

from hpctrain.runtime.run import entry

entry.start("eval")  # signals recorded from the first moment; config mistakes as one sentence

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="eval", **entry.main_args())  # Hydra 1.3 and 1.4 alike
def main(cfg: DictConfig):  # -> the job's Outcome
    from hpctrain.runtime.run.job import job  # here: --help and --cfg never run a job

    with job(cfg, reader=True) as current:  # the model and data this project composes from the checkpoint
        run = current.build(training=False)  # its weights checked against the model before it takes memory
        # a signal under SLURM: the requeued job evaluates again
        run.evaluate(current.checkpoint, current.settings.eval.split)
        current.finish(run)
    return current.outcome


if __name__ == "__main__":
    main()
    entry.end()  # ranks > 0 skip the C++ destructors that can abort at exit
