"""Your project's code: models, networks and datasets, built from conf/ by name (`_target_`).

It uses hpctrain (the machinery beside it, carried untouched) only through hpctrain's public API:
`hpctrain.data` for datamodules and loaders, `hpctrain.UserError` for a mistake said in one sentence.
"""
