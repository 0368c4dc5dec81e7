"""hpctrain's config groups: trainer, callbacks, logger, paths, hydra, cluster, debug, extras (and the JSON
schemas editors use). Hydra reads them as pkg://hpctrain.conf, after the project's conf/, so a file of the
same group and name there replaces the one here (hydra_plugins/hpctrain_conf)."""
