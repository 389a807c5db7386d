"""What a checkpoint is: its format, its architecture, its weights and (for GGUF) its tokenizer.

Everything the engine knows about files on disk lives here, so no other module asks whether a
path ends in `.gguf`:

- `format.py`: `checkpoint_format(path)`, the one place that says which kind a path is;
- `arch.py`: `ModelArch` and `RopeScaling`, plain data that imports nothing of the engine;
- `metadata.py`: `ModelArch` and EOS ids from `config.json` or GGUF metadata (torch-free);
- `loader.py`: named tensors from safetensors or GGUF into each parameter's `weight_loader`;
- `gguf_tokenizer.py`: the parts of a tokenizer rebuilt from GGUF metadata.

It imports nothing above it (`.importlinter`): config, models and the worker ask it.
"""
