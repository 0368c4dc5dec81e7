"""Predict with a checkpoint: python src/predict.py ckpt_path=<file.ckpt> [predict.input=<folder or file>] [key=value ...]

The model and data: this project's configs composed from what the checkpoint proposes (as in eval.py). Every sample is
predicted exactly once, on one process or many (trainer=ddp_cpu, SLURM), and written in input order:
a CSV `index,path,class,prob_*` for a classifier, predictions.pt for any other predict_step.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without `pip install -e .`

from hpctrain.runtime.run import entry

entry.start("predict")  # signals recorded from the first moment; config mistakes as one sentence

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="predict", **entry.main_args())  # Hydra 1.3 and 1.4 alike
def main(cfg: DictConfig):  # -> the job's Outcome
    from hpctrain.runtime.run.job import job  # here: --help and --cfg never run a job

    with job(cfg, reader=True) as current:  # an existing predict.output is refused before anything runs
        run = current.build(training=False)  # its weights checked against the model before it takes memory
        from hpctrain.runtime.inference.predict import predict

        given = any(o.startswith("predict.split=") for o in current.overrides)
        predict(run, current.checkpoint, current.settings.predict, current.run_dir, split_given=given)
        current.finish(run)
    return current.outcome  # a signal under SLURM: the requeued job predicts again


if __name__ == "__main__":
    main()
    entry.end()  # ranks > 0 skip the C++ destructors that can abort at exit
