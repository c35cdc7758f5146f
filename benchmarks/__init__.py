"""The benchmark harness and its reports: speculative against plain decoding and prompt lookup on held-out
prompts (`benchmark.py`, tables and plots in `report.py`), plain decoding and verify costs against
transformers (`plain.py`), and speedup per batch size (`batch.py`)."""
