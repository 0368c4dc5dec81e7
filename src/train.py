"""Train a model: python src/train.py [experiment=...] [group=option ...] [key=value ...]

compose config -> preflight checks -> build data, model, trainer -> fit -> test -> report.
Nothing heavy is imported until the checks pass, so `--help`, `--cfg job` and every config or
launch mistake answer in well under a second.
"""

import sys
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without `pip install -e .`

from hpctrain.runtime.run import entry

entry.start("train")  # signals recorded from the first moment; config mistakes as one sentence

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

if TYPE_CHECKING:
    from hpctrain.runtime.storage.records import Outcome


@hydra.main(config_path="../conf", config_name="train", **entry.main_args())  # Hydra 1.3 and 1.4 alike
def main(cfg: DictConfig) -> float | None:
    from hpctrain.runtime.run.job import run_job  # imported here: --help and --cfg never run a job

    # the best of monitor.metric, for sweepers; in a sweep a failed job is recorded and the sweep goes on
    return run_job(train, cfg)


def train(cfg: DictConfig) -> "Outcome":
    from hpctrain.runtime.run.job import job
    from hpctrain.runtime.storage.checkpoints import start_point

    with job(cfg) as current:  # preflight: config, launcher vs trainer, run dir (one sentence if wrong)
        settings = current.settings  # hpctrain's own keys, typed and checked in the preflight
        init = settings.init_from
        # fresh, a checkpoint to continue, or this job's own when SLURM requeued it
        start = start_point(settings.ckpt_path, current.run_dir, cfg.paths.runs_dir, init_from=init.path)
        start.check_readable(init.path)  # a checkpoint is data: read as such before anything heavy
        run = current.build()  # data (checked on every rank), model, callbacks, loggers, trainer
        start.prepare(run.model, cfg.model, init)  # the checkpoint checked, or init_from's weights loaded
        if settings.train:
            run.fit(start.checkpoint)  # a signal: checkpoint where every rank agrees, then requeue or stop
        else:  # the model as built, or as ckpt_path left it, on the val split: a base before fine-tuning
            run.evaluate(start.checkpoint, "val")
        best = run.best_checkpoint()
        if settings.test and run.can_test():
            run.test(best)
        current.finish(run, best)
    return current.outcome  # completed, or stopped on a signal (a requeued job resumes in this run dir)


if __name__ == "__main__":
    main()
    entry.end()  # ranks > 0 skip the C++ destructors that can abort at exit
