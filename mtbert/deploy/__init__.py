"""Deploying a trained variant: ONNX export and int8 (`export`, `quantize`, torch side), the torch-free ONNX
Runtime engine (`engine`), the choice of engine for a folder (`predictors`), and the HTTP server (`server`)."""
