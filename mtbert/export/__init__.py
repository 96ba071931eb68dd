"""Build-time export (PyTorch): a trained variant's ONNX graphs, their check against PyTorch, the int8 choice
(variant.py, quantize.py) and the ensemble's export (ensemble.py). What runs them is mtbert/deploy/, which
imports nothing from here."""
