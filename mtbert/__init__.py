"""mtbert: multitask BERT fine-tuning (SST-5, Quora paraphrase, STS) as one reproducible DVC pipeline.

The library the pipeline's stages (`stages/`) are thin commands over, grouped as the pipeline runs:
`data` (raw files to tokenized batches), `model` (backbone, architectures, heads, saved folders),
`training` (the fine-tuning and masked-LM loops), `evaluation` (metrics, dumps, ensemble, statistics),
`inference` (trained models on new text) and `deploy` (the ONNX export, the torch-free ONNX Runtime
engine, the HTTP server). `Predictor` and `EnsemblePredictor` load a trained model folder, or the ensemble,
for use from Python; `mtbert predict` is the same from the shell.
"""

__all__ = ["EnsemblePredictor", "Predictor"]


def __getattr__(name: str):
    # Imported on first use, so a stage importing e.g. `mtbert.io` does not load the inference code
    # (dvc.yaml lists each stage's modules as its deps).
    if name in __all__:
        from mtbert import inference

        return getattr(inference, name)
    raise AttributeError(f"module 'mtbert' has no attribute {name!r}")
