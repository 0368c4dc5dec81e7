"""What comes after training: a trained checkpoint's model loaded and ready to call (`loaded`:
`hpctrain.load`), its predictions in input order on any number of processes (`predict`: src/predict.py),
and the model exported to run without hpctrain (`export`, with its `model_card`: src/export.py)."""
