"""The GGUF -> nanoVLM checkpoint converter's parts (tools/convert_gguf.py is the command):
gguf_file (reading the GGUF), nanovlm_config (config.json), weights (model.safetensors),
tokenizer (tokenizer.json and its configs)."""
