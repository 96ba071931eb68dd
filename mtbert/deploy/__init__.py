"""Running exported models, torch-free: the ONNX Runtime engine (`engine`), the ensemble's members and their
average (`members`), and the HTTP server (`server` and its pieces). It imports nothing from the layers above
it (tests/test_imports.py); the export that writes the graphs is mtbert/export/."""
