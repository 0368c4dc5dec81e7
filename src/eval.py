"""Evaluate a checkpoint: python src/eval.py ckpt_path=<path/to/file.ckpt> [eval.split=test|val] [key=value ...]

The model config comes from the checkpoint (the weights define the architecture), and so does the
data config unless you choose one (data=... or data.<key>=...). The test split where the model has a
`test_step` and the data a test split, else the validation split (said in one line); `eval.split` chooses.
The lifecycle is train.py's (Job).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without `pip install -e .`

from hpctrain.runtime.run import entry

entry.start("eval")  # signals recorded from the first moment; config mistakes as one sentence

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="eval", **entry.main_args())  # Hydra 1.3 and 1.4 alike
def main(cfg: DictConfig) -> dict[str, float]:
    from hpctrain.runtime.run.job import Job  # here: --help and --cfg never run a job
    from hpctrain.runtime.storage.checkpoints import existing_checkpoint

    with Job(cfg) as job:
        checkpoint = existing_checkpoint(job.settings.ckpt_path)
        cfg = job.from_checkpoint(checkpoint)  # the model (and data) it was trained with
        run = job.build(training=False)  # weights of another model: refused here
        with job.running(run):  # under SLURM a signal requeues the job, which evaluates again
            run.evaluate(checkpoint, job.settings.eval.split)
            return job.finish(run)
    return {}


if __name__ == "__main__":
    main()
    entry.end()  # ranks > 0 skip the C++ destructors that can abort at exit
