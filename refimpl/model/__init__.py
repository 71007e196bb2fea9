"""The models as pure functions over parameters keyed by checkpoint names: llama.py (Llama 3.2 text), llama_vision.py
(Llama 3.2 Vision: the text decoder with cross-attention layers over the vision encoder of refimpl.vision), their
configurations (config.py, vision_config.py), the ops they share (ops.py) and the activation names (names.py).

Names: files and modules say "vision" for Llama 3.2 Vision, the word users type (`--models 11b-vision`,
golden/toy-vision, the product's name); HF's "Mllama" stays only on what mirrors an HF class or config key
(MllamaConfig, MllamaTextConfig, `model_type: mllama`), so a reader can find its counterpart in transformers.
"""
