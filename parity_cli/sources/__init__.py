"""Stage 1: the files a model comes in (Hugging Face safetensors, GGUF, ONNX), read within
bounds and never executed: config, tensor index, lazily read tensors."""
