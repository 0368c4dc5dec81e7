"""Export a checkpoint's model to run without this template:
python src/export.py ckpt_path=<file.ckpt> export.format=torch_export|onnx|safetensors [export.output=<file>]

load (the model with its data's preprocessing) -> example inputs -> trace and write -> load back and
check at another batch size -> model card. One process, on the CPU; the lifecycle is train.py's (`job`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # works without `pip install -e .`

from hpctrain.runtime.run import entry

entry.start("export")  # signals recorded from the first moment; config mistakes as one sentence

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="../conf", config_name="export", **entry.main_args())  # Hydra 1.3 and 1.4 alike
def main(cfg: DictConfig):  # -> the job's Outcome
    from hpctrain.runtime.inference import export, model_card  # here: --help and --cfg never run a job
    from hpctrain.runtime.run.job import job

    with job(cfg, one_process=True, reader=True) as current:  # preflight: config, one process, run dir
        chosen = export.check_installed(cfg.export.format)  # onnx and safetensors need the `export` extra
        path = export.output_path(chosen, cfg.export.output, current.run_dir)
        from hpctrain.runtime.inference import loaded  # torch: only once the preflight passed

        # model(preprocess(raw inputs)), composed as for the job from what the checkpoint proposes
        predictor = loaded.load(current.checkpoint, current.chosen)
        # one sample more than the traced batch: the export is checked at a batch size it was not traced with
        inputs = export.sample_inputs(predictor, current.cfg, rows=cfg.export.batch_size + 1)
        current.record()  # config.yaml and run.yaml in the run dir, as for train and eval
        exported = export.write(predictor, chosen, path, inputs, cfg.export.batch_size)
        card = model_card.write(exported, predictor, current.checkpoint)  # beside the export
        export.report(exported, card, current.run_dir)
    return current.outcome


if __name__ == "__main__":
    main()
