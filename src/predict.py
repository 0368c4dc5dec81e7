"""Predict with a checkpoint: python src/predict.py ckpt_path=<file.ckpt> [predict.input=<folder or file>] [key=value ...]

The model and data come from the config stored in the checkpoint (as in eval.py). Every sample is
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
def main(cfg: DictConfig) -> None:
    from hpctrain.runtime.run.job import Job  # here: --help and --cfg never run a job
    from hpctrain.runtime.storage.checkpoints import existing_checkpoint

    with Job(cfg) as job:  # preflight, and an existing predict.output is refused before anything runs
        checkpoint = existing_checkpoint(job.settings.ckpt_path)
        job.from_checkpoint(checkpoint)  # the model (and data) it was trained with
        run = job.build(training=False)  # weights of another model: refused here
        from hpctrain.runtime.inference.predict import predict

        with job.running(run):  # under SLURM a signal requeues the job, which predicts again
            given = any(o.startswith("predict.split=") for o in job.overrides)
            predict(run, checkpoint, job.settings.predict, job.run_dir, split_given=given)
            job.finish(run)


if __name__ == "__main__":
    main()
    entry.end()  # ranks > 0 skip the C++ destructors that can abort at exit
